"""The Starlette application: the page (`GET /`, its files under `/static/`) and the JSON API.

- `POST /api/estimate`: the keyword arguments of `pipeline.estimate.estimate` as a JSON object
  (plus one search: `"max_batch_size"`, `"max_seq_len"`, `"layouts"` or `"min_gpus"`: true, the last two answered
  by `pipeline.estimate.layouts`); the answer is what `python -m pipeline estimate ... --json` prints for the same
  options. `GET /api/estimate?model=...` takes the same fields as a query (not the JSON-object ones; `lengths` as
  token counts joined by commas): a link to an answer.
- `POST /api/layouts` (or GET with a query): a `"layouts": true` or `"min_gpus": true` question answered as it
  goes, one JSON object a line (NDJSON): {"event": "start", "layouts": the rows to come (null for the fewest GPUs)},
  {"event": "count", "num_gpus", "layouts"} before each N of the fewest-GPUs search, {"event": "row", "index",
  "row"} as each layout is answered (the exact method's in the order its simulations end), then {"event": "end",
  "answer": what /api/estimate answers}; or, last, {"event": "stopped", "reason"} at the server's time limit (the
  rows sent stand) or {"event": "error", "error"}. Bad input is HTTP 400 before any line.
- `GET /api/models`: the registry; `GET /api/gpus`: the GPU catalogue; `GET /api/accuracy`: each
  method's measured accuracy on the standard step; `GET /api/setting-accuracy?client=sft&precision=...`:
  each method's measured accuracy on the setting an answer names (its client, precision, lora_r,
  quantization, liger_kernel, num_gpus, sharding, tensor_parallel); `GET /api/info`: the words of the options
  and the server's limits.

Bad input is HTTP 400 with `{"error": "<one line>"}`; a body over the limit 413, a simulation past
the time limit 503, anything unexpected 500, each with one line and no traceback (the traceback goes
to the server's log). No state is kept between requests: the formula's questions run in a thread of
this process (pure Python, no shared mutable state), the others in the simulator's process
(`pipeline.serve.worker`), one at a time.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pipeline.core.errors import UserError
from pipeline.core.text import first_line
from pipeline.serve.catalogue import accuracy as accuracy_of_methods
from pipeline.serve.catalogue import gpus as gpu_catalogue
from pipeline.serve.catalogue import models as registry_models
from pipeline.serve.catalogue import setting_accuracy
from pipeline.serve.questions import (LIMITS, MAX_BODY_BYTES, MAX_NUM_GPUS, answer, check, from_query,
                                      layouts_events_of, needs_torch, parse_body, to_json)
from pipeline.serve.worker import SimulationTimeout, Simulator, WorkerDied, log

STATIC = Path(__file__).with_name("static")
# A formula question answered at start: its modules are imported before the first page asks.
WARM_FORMULA = {"model": "EleutherAI/pythia-14m", "batch": 1, "seq": 16, "precision": "bf16", "method": "formula"}
# The page loads nothing from elsewhere (no CDN) and runs no inline script.
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                                      "base-uri 'none'; frame-ancestors 'self'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(simulator: Simulator | None = None, timeout_s: float = 120.0, warm: bool = True) -> Starlette:
    """The application; `simulator` (default: one worker process with `timeout_s` per question) runs
    the questions that need torch."""
    simulator = simulator or Simulator(timeout_s, warm)
    lists = {}

    def listed(name, make):
        if name not in lists:
            lists[name] = make()
        return lists[name]

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=HEADERS)

    async def estimate_endpoint(request: Request) -> Response:
        try:
            if request.method == "POST":
                question = parse_body(await read_body(request))
            else:
                question = from_query(request.query_params)
            question = check(question)
            if needs_torch(question):
                result = await run_in_threadpool(simulator.ask, question)
            else:
                result = await run_in_threadpool(answer, question)
        except UserError as exc:
            return error(413 if str(exc).startswith("the request is over") else 400, str(exc))
        except SimulationTimeout as exc:
            return error(503, str(exc))
        except WorkerDied as exc:
            log(str(exc))
            return error(500, str(exc))
        return Response(to_json(result), media_type="application/json")

    async def layouts_endpoint(request: Request) -> Response:
        try:
            question = check(parse_body(await read_body(request)) if request.method == "POST"
                             else from_query(request.query_params))
            if not (question.get("layouts") or question.get("min_gpus")):
                raise UserError('/api/layouts answers "layouts": true or "min_gpus": true (the other questions: '
                                '/api/estimate)')
            events = simulator.ask_stream(question) if needs_torch(question) else layouts_events_of(question)
            first = await run_in_threadpool(next, events, None)  # bad input raises here, before any line
        except UserError as exc:
            return error(413 if str(exc).startswith("the request is over") else 400, str(exc))
        except WorkerDied as exc:
            log(str(exc))
            return error(500, str(exc))
        return StreamingResponse(event_lines(first, events), media_type="application/x-ndjson")

    async def models(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(listed, "models", registry_models))

    async def gpus(request: Request) -> Response:
        return JSONResponse(listed("gpus", gpu_catalogue))

    async def accuracy(request: Request) -> Response:
        return JSONResponse(listed("accuracy", accuracy_of_methods))

    async def accuracy_of_setting(request: Request) -> Response:
        try:
            return JSONResponse(await run_in_threadpool(setting_accuracy, from_query(request.query_params)))
        except UserError as exc:
            return error(400, str(exc))

    async def info(request: Request) -> Response:
        return JSONResponse(listed("info", lambda: server_info(simulator.timeout_s)))

    async def internal(request: Request, exc: Exception) -> Response:
        return error(500, f"internal error: {first_line(exc)}")  # Starlette logs the traceback

    def prepare():
        """The lists and the formula's imports, before the first page asks for them."""
        for name, make in (("models", registry_models), ("gpus", gpu_catalogue), ("accuracy", accuracy_of_methods)):
            listed(name, make)
        with contextlib.suppress(UserError):
            answer(check(WARM_FORMULA))
        with contextlib.suppress(UserError):
            setting_accuracy({"precision": WARM_FORMULA["precision"]})  # reads the settings' validation table

    @contextlib.asynccontextmanager
    async def lifespan(app):
        simulator.start()
        threading.Thread(target=prepare, daemon=True).start()
        try:
            yield
        finally:
            simulator.close()

    routes = [Route("/", page), Route("/api/estimate", estimate_endpoint, methods=["GET", "POST"]),
              Route("/api/layouts", layouts_endpoint, methods=["GET", "POST"]),
              Route("/api/models", models), Route("/api/gpus", gpus), Route("/api/accuracy", accuracy),
              Route("/api/setting-accuracy", accuracy_of_setting),
              Route("/api/info", info), Mount("/static", StaticFiles(directory=STATIC), name="static")]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={Exception: internal})


async def event_lines(first: dict, events):
    """The events as NDJSON lines; a failure after the first line is the last line, one sentence; a client that
    goes away closes the events (the simulator stops its search)."""
    import json

    try:
        yield json.dumps(first) + "\n"
        async for event in iterate_in_threadpool(events):
            yield json.dumps(event) + "\n"
    except UserError as exc:
        yield json.dumps({"event": "error", "error": str(exc)}) + "\n"
    except WorkerDied as exc:
        log(str(exc))
        yield json.dumps({"event": "error", "error": str(exc)}) + "\n"
    finally:
        with contextlib.suppress(ValueError):  # still running in a thread of its own (a client gone mid-ask)
            await run_in_threadpool(events.close)


async def read_body(request: Request) -> bytes:
    """The body, refused past MAX_BODY_BYTES (before reading it when the client says its length)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise UserError(f"the request is over the server's limit of {MAX_BODY_BYTES >> 20} MiB")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise UserError(f"the request is over the server's limit of {MAX_BODY_BYTES >> 20} MiB")
    return bytes(body)


def server_info(timeout_s: float) -> dict:
    """The options' words (pipeline.core.vocabulary, the adapters' targets) and the server's limits."""
    from pipeline.training.adapters import ALL_LINEAR
    from pipeline.core.vocabulary import (CLIENTS, METHODS, OPTIMIZERS, OPTIMS, PRECISION_MODES, PRECISIONS,
                                          QUANTIZATIONS, SHARDINGS, WEIGHTS_DTYPES,
                                          CRASHING_SHARDINGS)

    # a precision by what it is made of: the page asks the trainer clients for weights and autocast, as
    # TrainingArguments and a model's dtype do (vocabulary.precision_of)
    modes = {name: {"weights": mode.weights, "autocast": mode.autocast} for name, mode in PRECISION_MODES.items()}
    return {"precisions": list(PRECISIONS), "precision_modes": modes, "weights_dtypes": list(WEIGHTS_DTYPES),
            "clients": list(CLIENTS), "optimizers": list(OPTIMIZERS),
            "optims": list(OPTIMS), "shardings": list(SHARDINGS + CRASHING_SHARDINGS), "quantizations": list(QUANTIZATIONS),
            "methods": list(METHODS), "all_linear": ALL_LINEAR, "limits": LIMITS + f"; a simulation stops "
            f"after {timeout_s:g} s", "timeout_s": timeout_s, "max_num_gpus": MAX_NUM_GPUS}
