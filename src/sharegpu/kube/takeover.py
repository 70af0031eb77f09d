"""Taking back an object in a name sharegpu owns that someone else wrote first (a tenant's ConfigMap
under a hand-off's name): it is replaced whole, never merged with, so nothing the other writer put
there (labels, owners, extra keys, binaryData) is left. Both writes are conditional: on the
resourceVersion read back, and, for an immutable object, which cannot be replaced, on its uid before
it is deleted and made again. A conflict goes to the caller, who reads again on its next pass."""

from __future__ import annotations

import copy
from typing import Any

from sharegpu.kube import client

Json = dict[str, Any]


async def overwrite(api: client.KubeApi, collection: str, path: str, body: Json, found: Json) -> Json:
    """Make the object at `path` (in `collection`; `found` is what was read there) hold `body`."""
    meta = found.get("metadata") or {}
    replacement = copy.deepcopy(body)
    if found.get("immutable"):
        await api.delete(path, preconditions={"uid": str(meta.get("uid", ""))}, missing_ok=True)
        return await api.create(collection, replacement)
    replacement.setdefault("metadata", {})["resourceVersion"] = meta.get("resourceVersion", "")
    return await api.replace(path, replacement)
