"""API keys in the shared state, for a fleet whose replicas read keys from Redis (`--redis-url`):

    python -m agent_server.fleet.keys --redis-url redis://host:6379/0 add        # prints a new key, once
    python -m agent_server.fleet.keys --redis-url ... add --key "$EXISTING_KEY"  # or registers one you made
    python -m agent_server.fleet.keys --redis-url ... revoke k_0123456789ab      # a fingerprint (or the key)
    python -m agent_server.fleet.keys --redis-url ... list

`revoke` takes `k_` and 12 hex digits (what `add` and `list` print), or the key; a fingerprint of no key added
here is revoked all the same (the servers may have that key from their environment or a file), with a warning:
a mistyped one leaves the real key working.

Only a key's SHA-256 is stored. A key added or revoked here counts on every replica within one sync period
(0.25 s); keys configured by environment or file keep working without Redis (docs/operations.md). A revoked
key's tokens are refused too. A server in `--auth auto` (the default) turns auth on with the first key added
here. (AGENT_SERVER_REDIS_URL and AGENT_SERVER_REDIS_PREFIX work as for the server.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import sys
from collections.abc import Sequence

from agent_server.fleet.auth import FINGERPRINT_HEX, AuthConfigError, check_key_format, fingerprint, key_hash
from agent_server.fleet.shared_state import DEFAULT_PREFIX, RedisState, SharedStateUnavailable
from agent_server.logging import configure_logging

NEW_KEY_BYTES = 32
KEY_PREFIX = "sk-"
MIN_ADDED_KEY_CHARS = 20  # `add --key`: a key chosen by hand is still a password
FINGERPRINT = re.compile(rf"k_[0-9a-f]{{{FINGERPRINT_HEX}}}")  # what auth.fingerprint makes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agent_server.fleet.keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("AGENT_SERVER_REDIS_URL"),
                        help="the fleet's Redis (env AGENT_SERVER_REDIS_URL)")
    parser.add_argument("--redis-prefix", default=os.environ.get("AGENT_SERVER_REDIS_PREFIX", DEFAULT_PREFIX),
                        help=f"the fleet's key prefix in Redis, as the servers' (env AGENT_SERVER_REDIS_PREFIX, "
                             f"default {DEFAULT_PREFIX!r})")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="add a key (a new random one unless --key)")
    add.add_argument("--key", help="register this key instead of making one (a script passes it from a variable of "
                                   "its own, as in --key \"$EXISTING_KEY\", so it stays out of the shell history)")
    revoke = commands.add_parser("revoke", help="revoke a key (and its tokens) on every replica")
    revoke.add_argument("key", help="the key's fingerprint (k_...) or the key itself")
    commands.add_parser("list", help="fingerprints of the keys added here, and of revoked keys")
    return parser


def added_key(given: str) -> str:
    """`add --key`'s argument, checked. Raises AuthConfigError (before Redis is asked)."""
    key = check_key_format(given)
    if len(key) < MIN_ADDED_KEY_CHARS:
        raise AuthConfigError(f"--key: at least {MIN_ADDED_KEY_CHARS} characters (a key is a password; leave "
                              "--key out for a random one)")
    return key


def revoked_fingerprint(given: str) -> str:
    """`revoke`'s argument -> the fingerprint to revoke. Raises AuthConfigError (checked before Redis is asked)."""
    key_id = given if given.startswith("k_") else fingerprint(check_key_format(given))
    if not FINGERPRINT.fullmatch(key_id):
        raise AuthConfigError(f"{given!r} is not a fingerprint: k_ and 12 hex digits (or give the key)")
    return key_id


async def run(args: argparse.Namespace, state: RedisState) -> int:
    try:
        await state.refresh()
        if args.command == "add":
            key = added_key(args.key) if args.key else KEY_PREFIX + secrets.token_urlsafe(NEW_KEY_BYTES)
            await state.add_key(key_hash(key), fingerprint(key))
            print(f"added {fingerprint(key)}" + ("" if args.key else f"\n{key}"))
        elif args.command == "revoke":
            key_id = revoked_fingerprint(args.key)
            await state.revoke_key(key_id)
            print(f"revoked {key_id}")
            if key_id not in state.mirror.key_hashes.values():  # a typo would leave the real key working
                print(f"warning: {key_id} is not a key added here (`list` shows those); if the servers have it by "
                      "environment or file it is revoked now, else check the fingerprint", file=sys.stderr)
        else:
            for key_id in sorted(state.mirror.key_hashes.values()):
                print(f"{key_id}{' (revoked)' if key_id in state.mirror.revoked_keys else ''}")
            for key_id in sorted(state.mirror.revoked_keys - set(state.mirror.key_hashes.values())):
                print(f"{key_id} (revoked; configured elsewhere)")
    finally:
        await state.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("warning")  # log lines to stderr: stdout is the answer
    if not args.redis_url:
        parser.error("--redis-url (or AGENT_SERVER_REDIS_URL) is required: keys are kept in the fleet's Redis")
    try:  # what was typed, before Redis is asked
        if args.command == "revoke":
            revoked_fingerprint(args.key)
        elif args.command == "add" and args.key:
            added_key(args.key)
    except AuthConfigError as exc:
        parser.error(str(exc))
    try:
        state = RedisState(args.redis_url, prefix=args.redis_prefix)
    except ValueError as exc:  # a URL redis cannot read
        parser.error(f"--redis-url: {exc}")
    try:
        sys.exit(asyncio.run(run(args, state)))
    except AuthConfigError as exc:
        parser.error(str(exc))
    except SharedStateUnavailable as exc:
        print(f"error: Redis is unavailable: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
