"""How often a wss:// connect from the websockets sync client (what the ElevenLabs SDK uses) fails or hangs,
against a live server with TLS and the FakeEngine, with the server's TLS 1.3 session tickets as shipped (none)
or turned back on (`--tickets 2`, OpenSSL's default).

The sync client starts a reader thread before it writes the upgrade request; the server's session tickets
arrive right after the handshake, so that thread's SSL_read and the main thread's SSL_write run on one SSL
object at once, which OpenSSL does not allow: the request is lost (the connect times out) or the call fails.
Busy CPUs make the overlap likelier; `--busy` starts that many spinning processes beside it. `--client threaded`
is a bare TLS client that starts its reader thread at once and then writes `GET /readyz` (the same race, a wider
window); `--client websockets` (the default) is the sync client itself.

Usage:
    python scripts/tls_ticket_race.py --connects 1000 --busy 2             # as shipped
    python scripts/tls_ticket_race.py --connects 1000 --busy 2 --tickets 2 # tickets on: the failures
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import selectors
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path

from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import live_server, make_test_certificate


def spin() -> None:
    while True:
        pass


def threaded_get(port: int, client_tls: ssl.SSLContext, timeout_s: float) -> None:
    """GET /readyz with a reader thread already waiting, as a full-duplex client does; raises on no reply."""
    with socket.create_connection(("127.0.0.1", port)) as raw, \
            client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        replied = threading.Event()

        def read() -> None:
            poller = selectors.DefaultSelector()
            poller.register(tls, selectors.EVENT_READ)
            while not replied.is_set() and poller.select(timeout_s):
                try:
                    data = tls.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                if b" 200 " in data:
                    replied.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        tls.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        if not replied.wait(timeout_s):
            raise TimeoutError("no reply")
    reader.join(timeout_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connects", type=int, default=1000)
    parser.add_argument("--tickets", type=int, default=None, help="the server's TLS 1.3 tickets (default: as shipped)")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the test")
    parser.add_argument("--client", choices=("websockets", "threaded"), default="websockets")
    parser.add_argument("--open-timeout-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_test_certificate(Path(tmp))
        settings = Settings(data_dir=Path(tmp), tls_certfile=str(cert), tls_keyfile=str(key))
        client_tls = ssl.create_default_context(cafile=str(cert))
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
        for spinner in spinners:
            spinner.start()
        try:
            with live_server(FakeEngine(), settings) as live:
                server_tls = live.server.config.ssl
                assert server_tls is not None
                if args.tickets is not None:
                    server_tls.num_tickets = args.tickets
                tickets = server_tls.num_tickets
                failures: dict[str, int] = {}
                start_s = time.monotonic()
                for _ in range(args.connects):
                    try:
                        if args.client == "threaded":
                            threaded_get(live.port, client_tls, args.open_timeout_s)
                        else:
                            with connect(live.ws_url, ssl=client_tls, open_timeout=args.open_timeout_s):
                                pass
                    except Exception as exc:
                        kind = type(exc).__name__
                        failures[kind] = failures.get(kind, 0) + 1
                wall_s = time.monotonic() - start_s
        finally:
            for spinner in spinners:
                spinner.kill()
    failed = sum(failures.values())
    result = {"client": args.client, "connects": args.connects, "server_tls13_tickets": tickets,
              "busy_processes": args.busy, "failed": failed, "failed_by_kind": failures,
              "failed_per_1000": round(1000 * failed / args.connects, 1),
              "wall_s": round(wall_s, 1), "python": sys.version.split()[0], "openssl": ssl.OPENSSL_VERSION,
              "cpus": os.cpu_count()}
    print(f"| client | tickets | connects | failed | per 1000 | by kind |\n|---|---|---|---|---|---|\n"
          f"| {args.client} | {tickets} | {args.connects} | {failed} | {result['failed_per_1000']} "
          f"| {failures or '-'} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
