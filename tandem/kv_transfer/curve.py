"""The KV link authenticated and encrypted with CurveZMQ (libsodium, through pyzmq), so a
decode instance takes KV only from the prefill instances it was given, and a prefill
instance sends KV only to a peer that proves it holds the decode instances' secret key.

    tandem keys generate keys/ --name decode     # keys/decode.key, keys/decode.key_secret
    tandem keys generate keys/prefill --name p0  # one per prefill instance (or shared)
    tandem serve --role decode  --kv-secret-key keys/decode.key_secret --kv-peer-keys keys/prefill
    tandem serve --role prefill --kv-secret-key keys/prefill/p0.key_secret --kv-peer-keys keys/decode.key

The secret files are ZeroMQ's certificate format (zmq.auth); the `.key` files hold the
public half only and may be copied anywhere. A sender whose key is not among the decode
instance's peers is refused during the handshake: none of its frames reach the engine, and
the refusal is logged and counted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("tandem")


def generate(folder: str, name: str) -> tuple[Path, Path]:
    """A new key pair in `folder`: (public file, secret file, readable by the owner only)."""
    if not zmq.has("curve"):
        raise ValueError("keys: this pyzmq's libzmq was built without CURVE (libsodium)")
    Path(folder).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: str, field: str, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: cannot read a CURVE key from {path}: {e}") from None
    if secret and private is None:
        raise ValueError(f"{field}: {path} holds a public key; give the .key_secret file")
    return public, private


class Peers:
    """The public keys a decode instance accepts, asked by ZeroMQ's authenticator for every
    connecting sender."""

    def __init__(self, folder: str) -> None:
        if not Path(folder).is_dir():
            raise ValueError(f"kv_peer_keys: {folder} is not a folder of public .key files")
        self.allowed = set(zmq.auth.load_certificates(folder))
        if not self.allowed:
            raise ValueError(f"kv_peer_keys: no public .key files in {folder}")
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.refused += 1
        log.warning("kv link: refused a sender with an unknown key (%s...)", key[:8].decode())
        return False


def secure_receiver(
    socket: zmq.Socket, secret_key: str, peer_keys: str
) -> tuple[ThreadAuthenticator, Peers]:
    """Make `socket` (not yet bound) a CURVE server that admits only `peer_keys`' senders:
    (the authenticator thread, to stop with the socket; the peers, counting refusals)."""
    public, private = _load(secret_key, "kv_secret_key", secret=True)
    peers = Peers(peer_keys)
    auth = ThreadAuthenticator(socket.context, log=logging.getLogger("tandem.kv.auth"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=peers)
    socket.curve_secretkey, socket.curve_publickey = private, public
    socket.curve_server = True
    return auth, peers


class SenderKeys:
    """A prefill instance's key pair and the decode instances' public key."""

    def __init__(self, secret_key: str, server_key: str) -> None:
        self.public, self.secret = _load(secret_key, "kv_secret_key", secret=True)
        self.server, _ = _load(server_key, "kv_peer_keys", secret=False)

    def apply(self, socket: zmq.Socket) -> None:
        """Before connect."""
        socket.curve_secretkey, socket.curve_publickey = self.secret, self.public
        socket.curve_serverkey = self.server
