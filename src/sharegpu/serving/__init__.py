"""What sharegpu's HTTPS servers share: certificates (a private CA, serving and client
certificates with the names they will be reached by) and TLS contexts that follow their files and
can require a client certificate. No Kubernetes API access here."""
