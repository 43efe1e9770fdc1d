"""A payments service to put behind `idem serve`: deploy/compose.yaml runs it from a stock
Python image, with nothing but the standard library.

    python3 payments.py [--port 3000]

POST /charges             charges `amount_cents` of the JSON body and answers 201 with the
                          charge; the `Idempotency-Key` the gateway forwards is passed on to the
                          payment provider (here a dictionary), which charges a key once.
GET  /charges/by-key/KEY  the charge made under KEY (200), or 404: the lookup
                          `idem serve --reconcile 'GET /charges/by-key/{key}'` asks.
GET  /healthz             200: the service answers.
"""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

LOCK = threading.Lock()
# The provider's ledger: one charge per key, and every charge.
BY_KEY = {}
CHARGES = []


class Handler(BaseHTTPRequestHandler):
    def answer(self, status, document):
        body = json.dumps(document).encode() + b"\n"
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/healthz":
            self.answer(200, {"status": "ok"})
        elif self.path.startswith("/charges/by-key/"):
            key = unquote(self.path[len("/charges/by-key/"):])
            with LOCK:
                charge = BY_KEY.get(key)
            if charge is None:
                self.answer(404, {"error": "no charge under this key"})
            else:
                self.answer(200, charge)
        else:
            self.answer(404, {"error": "not found"})

    def do_POST(self):
        if self.path != "/charges":
            self.answer(404, {"error": "not found"})
            return
        length = int(self.headers.get("content-length") or 0)
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
            amount = int(request["amount_cents"])
        except (ValueError, KeyError, TypeError):
            self.answer(400, {"error": "a JSON body with amount_cents"})
            return
        key = self.headers.get("idempotency-key")
        with LOCK:
            # The provider charges a key once: a second attempt gets the first charge.
            charge = BY_KEY.get(key) if key else None
            if charge is None:
                charge = {"id": f"ch_{len(CHARGES) + 1}", "amount_cents": amount, "key": key}
                CHARGES.append(charge)
                if key:
                    BY_KEY[key] = charge
        self.answer(201, charge)

    def log_message(self, *args):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
