"""Request identity: the gateway's own id for every request, and the client's `X-Request-Id` as a label.

Everything downstream (NATS subjects, KV streams, decode's memory of closed streams) is keyed by the internal id, so a
client may reuse a label, one request after another or at once. The label is only echoed and logged.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from services.gateway.errors import bad_request
from shared.wire.protocol import is_valid_request_id

REQUEST_ID_HEADER = "X-Request-Id"
MAX_LABEL_LEN = 128


@dataclass(frozen=True)
class RequestIdentity:
    """Args:
    request_id: the internal id: `<label>-<16 random hex>` (so grepping the label finds every service's lines), else
        a uuid4 hex.
    label: the client's `X-Request-Id`, or None.
    """

    request_id: str
    label: str | None = None

    @property
    def echo(self) -> str:
        """What `X-Request-Id` answers: the client's label, else the internal id."""
        return self.label if self.label is not None else self.request_id

    def log_fields(self) -> dict[str, str]:
        """`request_id`, and the label as `client_request_id`."""
        if self.label is None:
            return {"request_id": self.request_id}
        return {"request_id": self.request_id, "client_request_id": self.label}


def identify(label: str | None) -> RequestIdentity:
    """A fresh identity for one request.

    Raises:
        ApiError: (400) the label is not 1-128 letters, digits, '-' or '_' (it must fit a NATS subject token).
    """
    if label is None:
        return RequestIdentity(uuid.uuid4().hex)
    if not (len(label) <= MAX_LABEL_LEN and is_valid_request_id(label)):
        raise bad_request(f"{REQUEST_ID_HEADER} must be 1-{MAX_LABEL_LEN} letters, digits, '-' or '_'")
    return RequestIdentity(f"{label}-{secrets.token_hex(8)}", label)
