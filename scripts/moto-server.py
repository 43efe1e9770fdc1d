"""moto in server mode, the way the tests need it: a local AWS (SQS, DynamoDB) on loopback.

    <moto venv>/bin/python scripts/moto-server.py [--port 5000] [--durable FILE]

Run by `scripts/services` (port 5000) and by the tests that kill and restart a server of their
own (`--durable`).

- One request at a time. moto's threaded server does not hold an item between a condition's
  check and its write, so two racing conditional writes could both succeed, which DynamoDB
  never allows. Serving requests one by one makes each conditional write atomic.
- No per-request log line (werkzeug's request log is silenced; warnings and errors stay).
- `--durable FILE`: moto keeps its state in memory and a restarted moto would come back empty,
  which DynamoDB never does. With this flag every request is appended to FILE by moto's own
  recorder before moto applies it (and so before it answers), and a server started on an
  existing FILE first replays it, in order, in-process. A server killed with SIGKILL and
  started again therefore comes back with every write it answered, and with those it had
  received but not applied or answered: the same as a server that applied a write and lost
  its answer, which clients must handle anyway. A last line cut short by the kill was never
  applied and is skipped. Replays are exact because the requests carry their own times (the
  stores decide with the caller's clock).
"""

import argparse
import base64
import json
import logging
import os
import sys
from urllib.parse import urlsplit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--durable", metavar="FILE", help="record requests to FILE; replay it on start")
    args = parser.parse_args()

    if args.durable:
        # moto's recorder reads these when it is imported.
        os.environ["MOTO_ENABLE_RECORDING"] = "True"
        os.environ["MOTO_RECORDER_FILEPATH"] = args.durable

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    if args.durable and os.path.exists(args.durable):
        replayed = replay(app, args.durable)
        print(f"moto-server: replayed {replayed} requests from {args.durable}", file=sys.stderr, flush=True)
    run_simple(args.host, args.port, app, threaded=False, request_handler=MotoRequestHandler)


def replay(app, path: str) -> int:
    """Applies the recorded requests in FILE to `app`, without recording them again."""
    from moto.moto_api import recorder
    from werkzeug.test import Client

    client = Client(app)
    replayed = 0
    recorder._user_enabled = False
    try:
        with open(path, encoding="utf-8") as file:
            for line in file:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    # The kill cut this line short: moto had not applied it yet.
                    break
                body = entry.get("body") or b""
                if entry.get("body_encoded"):
                    body = base64.b64decode(body)
                url = urlsplit(entry["url"])
                headers = {
                    name: value
                    for name, value in entry["headers"].items()
                    if name.lower() not in ("content-length", "transfer-encoding")
                }
                client.open(
                    path=url.path or "/",
                    query_string=url.query,
                    method=entry["method"],
                    headers=headers,
                    data=body,
                    base_url=f"{url.scheme}://{url.netloc}",
                )
                replayed += 1
    finally:
        recorder._user_enabled = True
    return replayed


if __name__ == "__main__":
    main()
