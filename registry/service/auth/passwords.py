"""Password hashes: scrypt from `cryptography`, salted, parameters stored with the hash.

Format: `scrypt$<log2 n>$<r>$<p>$<salt, base64>$<key, base64>`. Checking costs ~50-100 ms of
CPU on purpose; callers run it in a thread so the event loop keeps serving.
"""

from __future__ import annotations

import base64
import hmac
import os

from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

LOG2_N, BLOCK_SIZE, PARALLELISM, KEY_BYTES = 15, 8, 1, 32
# Compared against when the user is unknown, so a wrong name costs as long as a wrong password.
_DUMMY = "scrypt$15$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="


class InvalidHash(ValueError):
    """A stored hash this module cannot read (the config loader reports it with its line)."""


def _derive(password: str, salt: bytes, log2_n: int, r: int, p: int) -> bytes:
    kdf = Scrypt(salt=salt, length=KEY_BYTES, n=2**log2_n, r=r, p=p)
    return kdf.derive(password.encode("utf-8"))


def hash_password(password: str) -> str:
    salt = os.urandom(16)
    key = _derive(password, salt, LOG2_N, BLOCK_SIZE, PARALLELISM)
    return "$".join(["scrypt", str(LOG2_N), str(BLOCK_SIZE), str(PARALLELISM),
                     base64.b64encode(salt).decode(), base64.b64encode(key).decode()])


def parse_hash(stored: str) -> tuple[bytes, int, int, int, bytes]:
    """(salt, log2 n, r, p, key) of a stored hash; InvalidHash when it is not one."""
    parts = stored.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        raise InvalidHash("password hashes look like scrypt$15$8$1$<salt>$<key> "
                          "(write them with `ferry registry user add`)")
    try:
        log2_n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
        salt = base64.b64decode(parts[4], validate=True)
        key = base64.b64decode(parts[5], validate=True)
    except ValueError as exc:
        raise InvalidHash(f"unreadable scrypt hash: {exc}") from None
    if not (10 <= log2_n <= 20 and 1 <= r <= 32 and 1 <= p <= 16 and salt and key):
        raise InvalidHash("scrypt parameters out of range (log2 n 10-20, r 1-32, p 1-16)")
    return salt, log2_n, r, p, key


def check_password(password: str, stored: str | None) -> bool:
    """True when `password` matches `stored`; None (an unknown user) costs the same and fails."""
    salt, log2_n, r, p, key = parse_hash(stored or _DUMMY)
    derived = _derive(password, salt, log2_n, r, p)
    return hmac.compare_digest(derived, key) and stored is not None
