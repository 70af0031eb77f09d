"""The wire vocabulary, pure: every name sharegpu writes into Kubernetes and reads back from it.

Resource names, annotation keys and labels (`names`), REST paths (`paths`), quantities
(`quantity`), typed messages for the objects and protocols sharegpu reads (`wire`, `extender`,
`admission`), the codecs between those messages and the placement core's domain values (`pods`,
`devices`), the hand-off contract between the webhook and the extender (`handoff`), and the wording
of placement outcomes (`reasons`). Each is defined once and used by writer and reader alike.

No I/O happens here: the layer below is `sharegpu.core`, the layer above is `sharegpu.kube`.
"""
