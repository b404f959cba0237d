"""`python -m pipeline serve`: the web calculator, a page and a JSON API over `pipeline.estimate`.

One process keeps the simulator warm and answers questions with the library's public functions
(`estimate`, `max_batch_size`, `max_seq_len`): each answer is what `python -m pipeline estimate
... --json` prints for the same options. Modules: `questions` (a request's fields, checks and limits,
and its answer), `worker` (the simulator's process), `catalogue` (the registry, the GPUs, the
accuracy of each method), `app` (the Starlette application), `static/` (the page: one HTML, one
JS and one CSS file, no build step, nothing loaded from elsewhere). Importing this package imports
neither Starlette nor torch. How to run it locally and as a Hugging Face Space: docs/serve.md.
"""

from __future__ import annotations

import os

from pipeline.core.errors import UserError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860  # a Hugging Face Space's port


def add_cli(subparsers) -> None:
    from pipeline.core.arguments import positive_int

    parser = subparsers.add_parser("serve", help="serve the web calculator (a page and a JSON API)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default {DEFAULT_HOST}: this machine only; 0.0.0.0 for a Space)")
    parser.add_argument("--port", type=positive_int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument("--timeout", type=positive_int, default=120, metavar="S",
                        help="stop a simulation after S seconds (default 120)")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="do not run a small simulation when starting (the first exact answer pays it)")
    parser.set_defaults(handler=_serve_command)


def _serve_command(args) -> int:
    serve(args.host, args.port, args.timeout, warm=not args.no_warm_up)
    return 0


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, timeout_s: float = 120, warm: bool = True) -> None:
    """Run the server until interrupted."""
    try:
        import uvicorn

        from pipeline.serve.app import create_app
    except ImportError as exc:
        raise UserError(f"serve needs starlette and uvicorn ({exc.name} is missing): pip install -e .") from None
    from pipeline.inputs.configs import hub_is_offline, hub_reachable
    from pipeline.serve.worker import log

    if not hub_is_offline() and not hub_reachable():
        # The estimate command probes the Hub once per call and then uses the registry's embedded
        # facts; the server probes once, here, and its simulator inherits the answer.
        os.environ["HF_HUB_OFFLINE"] = "1"
        log("the Hugging Face Hub is not reachable: registry models use their embedded config facts")
    if host not in ("127.0.0.1", "localhost", "::1"):
        log(f"binding {host}: the calculator is reachable from other machines")
    uvicorn.run(create_app(timeout_s=timeout_s, warm=warm), host=host, port=port, log_level="info")
