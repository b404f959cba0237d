"""Seconds for the server's answers, as a user of the page waits for them (issue 21's targets beside them).

    python benchmarks/serve_speed.py [--model Qwen/Qwen2.5-7B] [--gpu "H100 80GB"]

Starts `python -m pipeline serve` on a free localhost port (HF_HUB_OFFLINE=1: the registry's embedded
facts), waits for the simulator's warm-up, then times HTTP round trips: the formula, the exact answer
for the model the first time (it builds the model: "cold") and again at another batch ("warm"), the
largest-batch and longest-sequence searches (formula and exact). Prints one row per question.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"exact, warm": "<= 1.5 s", "exact largest batch": "<= 5 s"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(url: str, question: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    req = urllib.request.Request(f"{url}/api/estimate", data=json.dumps(question).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    return time.perf_counter() - started, body


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-7B")
    parser.add_argument("--gpu", default="H100 80GB")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args(argv)
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--port", str(port)], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.perf_counter()
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/gpus", timeout=2).read()
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        base = {"model": args.model, "batch": 1, "seq": args.seq, "precision": "bf16", "gpu": args.gpu}
        warm_up, _ = ask(url, {**base, "model": "EleutherAI/pythia-14m", "method": "exact"})
        print(f"server up in {time.perf_counter() - started - warm_up:.1f} s; simulator warm (waited "
              f"{warm_up:.1f} s for its warm-up); {os.cpu_count()} CPUs")
        rows = [("formula", {**base, "method": "formula"}),
                ("exact, cold", {**base, "method": "exact"}),
                ("exact, warm", {**base, "batch": 2, "method": "exact"}),
                ("exact, warm (same question)", {**base, "batch": 2, "method": "exact"}),
                ("formula largest batch", {**base, "method": "formula", "max_batch_size": True}),
                ("exact largest batch", {**base, "method": "exact", "max_batch_size": True}),
                ("formula longest sequence", {**base, "method": "formula", "max_seq_len": True}),
                ("exact longest sequence", {**base, "method": "exact", "max_seq_len": True})]
        print(f"{'question':<30} {'seconds':>8}  {'target':<9} answer")
        for name, question in rows:
            seconds, body = ask(url, question)
            found = body.get("max_batch_size", body.get("max_seq_len"))
            what = body.get("error") or (f"{body['peak_bytes'] / 2**30:.2f} GiB" + (f", found {found}" if found else ""))
            print(f"{name:<30} {seconds:8.2f}  {TARGETS.get(name, ''):<9} {what}")
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
