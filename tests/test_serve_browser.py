"""The calculator's page in a real browser: Debian's Chromium, headless, driven by Playwright (its
Python package only: the system's browser, no browser download). The page asks a registry model
(the README's question: Llama-3.1-8B, QLoRA, batch 4, 4k tokens, RTX 4090) and a pasted config;
the numbers it shows are checked against `python -m pipeline estimate ... --json` for the same
question, the fit verdict's wording, the copied command, and the message beside the field of a bad
config; a several-GPU question's layouts table and fewest GPUs, formula and exact, against the command's
`--layouts` / `--min-gpus` JSON; an SFT question's pasted document lengths and its dataset's worst step. A PNG
screenshot of each state is written to tests/artifacts/serve/ (CI keeps that folder).

Skipped with the reason when Chromium or Playwright is missing, unless AVP_REQUIRE_BROWSER=1 (set by
.ci/run, which installs them): then it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from conftest import REPO
from serve_support import TINY_CONFIG, ask, cli_json, request, running_server

CHROMIUM = os.environ.get("AVP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "tests" / "artifacts" / "serve"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage"]
GIB = 2**30
QLORA = {"model": "meta-llama/Llama-3.1-8B", "batch": 4, "seq": 4096, "precision": "bf16", "lora_r": 16,
         "quantization": "nf4", "gpu": "RTX 4090"}
PASTED = {"config": TINY_CONFIG, "batch": 2, "seq": 128, "precision": "bf16", "gpu": "T4"}
# An SFTTrainer user's question in the command's words: bf16 weights, TRL's bf16=True, QLoRA
SFT_QLORA = {"model": "Qwen/Qwen2.5-0.5B", "batch": 4, "seq": 1024, "weights_dtype": "bf16", "client": "sft",
             "optim": "adamw_torch_fused", "checkpointing": True, "lora_r": 16, "quantization": "nf4",
             "gpu": "RTX 4090"}
# A 1.7B model in bf16 on T4s: on one GPU, and under ddp on every GPU, the weights, gradients and AdamW state
# leave no room for the step; fsdp fits on two.
# The file `accelerate config` writes for FSDP2 on 4 GPUs, as a user uploads it.
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
SEVERAL = {"model": "HuggingFaceTB/SmolLM2-1.7B", "batch": 2, "seq": 1024, "precision": "bf16", "checkpointing": True,
           "num_gpus": 4, "sharding": "fsdp", "gpu": "T4"}

pytestmark = pytest.mark.slow


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; or set AVP_CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e '.[dev]')"
    for module in ("starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e .)"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = _missing()
    if missing:
        if os.environ.get("AVP_REQUIRE_BROWSER") == "1":
            pytest.fail(f"AVP_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with running_server(ARTIFACTS / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # a 400 answer is logged by the browser as a failed resource: the page shows it beside the field
            page.on("console", lambda msg: errors.append(msg.text)
                    if msg.type == "error" and "status of 400" not in msg.text else None)
            page.errors = errors
            yield page
        finally:
            browser.close()


def cli_text(question: dict, method: str) -> str:
    """The page's "copy as CLI command" for the question (the flags in the page's order)."""
    flags = [("batch", "--batch"), ("seq", "--seq"), ("precision", "--precision"), ("weights_dtype", "--weights-dtype"),
             ("client", "--client"), ("optim", "--optim"), ("checkpointing", "--checkpointing"), ("lora_r", "--lora-r"),
             ("quantization", "--quantization"), ("num_gpus", "--num-gpus"), ("sharding", "--sharding"),
             ("shard_group", "--shard-group"), ("tensor_parallel", "--tensor-parallel"), ("gpu", "--gpu"),
             ("liger_kernel", "--liger-kernel"), ("layouts", "--layouts"), ("min_gpus", "--min-gpus"),
             ("num_generations", "--num-generations"), ("max_completion_length", "--max-completion-length"),
             ("beta", "--beta")]
    source = f"--model {question['model']}" if "model" in question else "--config config.json"
    parts = ["python -m pipeline estimate", source]
    for key, flag in flags:
        if key == "gpu" and "accelerate_config" in question:
            parts.append("--accelerate-config accelerate_config.yaml")  # the page names the file it was pasted from
        if question.get(key) is True:
            parts.append(flag)
        elif key in question:
            value = str(question[key])
            parts.append(f"{flag} {value if ' ' not in value else repr(value)}")
    return " ".join([*parts, f"--method {method}", "--json"])


SHOWN = """() => {
    const v = (id) => document.getElementById(id);
    const strong = v('verdict').querySelector('strong'), small = v('verdict').querySelector('small');
    return {method_shown: v('answer').dataset.method,
            peak: v('peak').dataset.bytes, peak_text: v('peak').textContent,
            reserved: v('reserved').dataset.bytes, reserved_text: v('reserved').textContent,
            headroom: v('headroom').dataset.bytes, fits: v('verdict').dataset.fits,
            verdict: strong ? strong.textContent : '', detail: small ? small.textContent : '',
            method: v('method').textContent, cli: v('cli').textContent, python: v('python').textContent,
            link: v('json-link').getAttribute('href'),
            components: Object.fromEntries([...document.querySelectorAll('#bar b[data-component]')]
                .map((b) => [b.dataset.component, Number(b.dataset.bytes)]))};
}"""


def poll(page, function: str, until, timeout_s: float, arg=None):
    """page.evaluate(function) every 0.1 s until `until(value)`; the value. (Not wait_for_function: its
    string predicates need eval, which the page's Content-Security-Policy forbids.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        value = page.evaluate(function, arg)
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s; the page shows {value!r}")
        page.wait_for_timeout(100)


def wait_for_answer(page, question: dict, method: str, timeout_s: float) -> dict:
    """What the page shows once it shows the `method`'s answer to this question (its copied command
    names both), read in the same instant."""
    cli = cli_text(question, method)
    return poll(page, SHOWN, lambda s: s["cli"] == cli and s["method_shown"] == method, timeout_s)


def wait_for_models(page) -> None:
    poll(page, "() => document.querySelectorAll('#models option').length", lambda n: n > 100, 30)


def check_numbers(s: dict, expected: dict, gpu_words: str) -> dict:
    """The page's figures and verdict (`s`, as shown) are those of `expected` (the command's JSON)."""
    assert float(s["peak"]) == expected["peak_bytes"]
    assert s["peak_text"] == f"{expected['peak_bytes'] / GIB:.2f} GiB"
    assert float(s["reserved"]) == expected["peak_reserved_bytes"]
    assert s["reserved_text"] == f"{expected['peak_reserved_bytes'] / GIB:.2f} GiB"
    assert float(s["headroom"]) == expected["headroom_bytes"]
    assert s["fits"] == str(expected["fits"]).lower()
    headroom = expected["headroom_bytes"] / GIB
    wording = (f"Fits on {gpu_words}: {headroom:.2f} GiB of headroom" if expected["fits"]
               else f"Does not fit on {gpu_words}: {-headroom:.2f} GiB short")
    assert s["verdict"] == wording
    assert s["detail"] == (f"reserved {expected['peak_reserved_bytes'] / GIB:.2f} GiB + "
                           f"{expected['outside_bytes'] / GIB:.2f} GiB outside PyTorch "
                           f"{'≤' if expected['fits'] else '>'} {expected['device_total_bytes'] / GIB:.2f} GiB "
                           f"({expected['method']})")
    assert s["method"].startswith(f"method: {expected['method']} (")
    parts = {k: v for k, v in expected["components"].items() if v > 0}
    assert {k: s["components"][k] for k in parts} == parts
    return s


def screenshot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    assert (ARTIFACTS / name).stat().st_size > 10_000


def test_a_registry_model_gets_its_verdict_within_a_minute(page, server):
    started = time.monotonic()
    page.goto(server)
    wait_for_models(page)
    # as a person would: the model by name, the shape, QLoRA, the GPU
    page.check("input[name=source][value=model]")
    page.fill("#model", "Llama-3.1-8B")  # the name, as a person types it: the page finds the registry id
    page.fill("#batch", str(QLORA["batch"]))
    page.fill("#seq", str(QLORA["seq"]))
    page.select_option("#adapters", "qlora")
    page.select_option("#quantization", QLORA["quantization"])
    page.fill("#lora_r", str(QLORA["lora_r"]))
    page.select_option("#gpu", QLORA["gpu"])
    formula_shown = wait_for_answer(page, QLORA, "formula", 30)
    formula_seconds = time.monotonic() - started
    screenshot(page, "01-registry-formula.png")  # the exact answer of an 8B model takes seconds more

    s = wait_for_answer(page, QLORA, "exact", 60 - formula_seconds)
    exact_seconds = time.monotonic() - started
    page.wait_for_timeout(300)
    screenshot(page, "02-registry-exact.png")
    assert exact_seconds < 60, f"the verdict took {exact_seconds:.0f} s"
    # the command's answers, once the page has shown them (no command competes with the server before)
    check_numbers(formula_shown, cli_json({**QLORA, "method": "formula"}), "the RTX 4090")
    expected = cli_json({**QLORA, "method": "exact"})
    check_numbers(s, expected, "the RTX 4090")
    assert s["cli"] == cli_text(QLORA, "exact")
    assert ('estimate(model="meta-llama/Llama-3.1-8B", batch=4, seq=4096, precision="bf16", lora_r=16, '
            'quantization="nf4", gpu="RTX 4090", method="exact")') in s["python"]
    status, linked, _ = request(server + s["link"])
    assert status == 200 and linked == expected
    (ARTIFACTS / "timings.json").write_text(json.dumps(
        {"formula_shown_s": round(formula_seconds, 2), "exact_shown_s": round(exact_seconds, 2)}))
    assert page.errors == []


def test_a_pasted_config_and_the_largest_batch(page, server):
    page.goto(server)
    wait_for_models(page)
    page.check("input[name=source][value=config]")
    page.fill("#config", json.dumps(TINY_CONFIG, indent=2))
    page.fill("#batch", str(PASTED["batch"]))
    page.fill("#seq", str(PASTED["seq"]))
    page.select_option("#adapters", "none")
    page.select_option("#gpu", PASTED["gpu"])
    s = wait_for_answer(page, PASTED, "exact", 120)
    page.wait_for_timeout(300)
    screenshot(page, "03-config-exact.png")
    check_numbers(s, cli_json({**PASTED, "method": "exact"}), "the T4")
    assert s["cli"] == cli_text(PASTED, "exact")

    page.click("#mbs-run")
    poll(page, "() => document.getElementById('mbs-exact').dataset.value", bool, 120)
    screenshot(page, "04-config-largest-batch.png")
    status, searched, _ = ask(server, {**PASTED, "method": "exact", "max_batch_size": True})
    assert status == 200
    assert page.inner_text("#mbs-exact").startswith(str(searched["max_batch_size"]))
    status, formula, _ = ask(server, {**PASTED, "method": "formula", "max_batch_size": True})
    assert page.inner_text("#mbs-formula") == str(formula["max_batch_size"])
    assert page.errors == []


def test_sfttrainer_with_liger_is_asked_as_the_command_asks_it(page, server):
    """Client sft on the page: TRL's default checkpointing ticked by choosing it, Liger's box; bf16-autocast
    chosen on the loop stays bf16 weights under bf16=True, the command's --weights-dtype bf16."""
    question = {"model": "Qwen/Qwen2.5-0.5B", "batch": 4, "seq": 1024, "weights_dtype": "bf16",
                "client": "sft", "optim": "adamw_torch_fused", "checkpointing": True, "gpu": "L4",
                "liger_kernel": True}
    page.goto(server)
    wait_for_models(page)
    page.check("input[name=source][value=model]")
    page.fill("#model", question["model"])
    page.fill("#batch", str(question["batch"]))
    page.fill("#seq", str(question["seq"]))
    page.select_option("#adapters", "none")
    page.select_option("#precision", "bf16-autocast")
    page.select_option("#client", "sft")
    assert page.is_checked("#checkpointing")  # SFTTrainer's default
    assert page.input_value("#weights_dtype") == "bf16" and page.input_value("#autocast") == "bf16"
    page.check("#liger_kernel")
    page.select_option("#gpu", question["gpu"])
    s = wait_for_answer(page, question, "exact", 120)
    page.wait_for_timeout(300)
    screenshot(page, "07-sft-liger-exact.png")
    expected = cli_json({**question, "method": "exact"})
    assert expected["client"] == "sft" and expected["liger_kernel"] is True
    assert expected["precision"] == "bf16-autocast"
    check_numbers(s, expected, "the L4")
    assert page.errors == []


WORST_SHOWN = """() => {
    const line = document.getElementById('worst-step');
    return {text: line.textContent, hidden: line.hidden, documents: line.dataset.documents,
            method: line.dataset.method, fits: line.dataset.fits, cli: document.getElementById('cli').textContent,
            python: document.getElementById('python').textContent};
}"""


def test_an_sft_datasets_document_lengths_give_its_worst_step(page, server):
    """Client sft, packing ticked and a dataset's token counts pasted (commas, spaces, a new line): the page sends
    them as `lengths` (whole numbers) and shows the answer's worst step in one line, the server's; the shareable
    link keeps them and the copied command reads them from a file. A count that is not a whole number is one line
    beside the box, and nothing is asked."""
    lengths = [100, 300, 512, 40]
    question = {"model": "HuggingFaceTB/SmolLM2-135M", "batch": 2, "seq": 512, "weights_dtype": "bf16",
                "client": "sft", "optim": "adamw_torch_fused", "checkpointing": True, "packing": True,
                "lengths": lengths, "gpu": "L4", "method": "exact"}
    posted = []

    def record(req):
        if req.method == "POST" and req.url.endswith("/api/estimate"):
            posted.append(json.loads(req.post_data))

    page.goto(server)
    wait_for_models(page)
    page.on("request", record)
    try:
        page.check("input[name=source][value=model]")
        page.fill("#model", question["model"])
        page.fill("#batch", str(question["batch"]))
        page.fill("#seq", str(question["seq"]))
        page.select_option("#adapters", "none")
        page.select_option("#gpu", question["gpu"])
        page.select_option("#client", "sft")
        page.check("#packing")
        page.fill("#lengths", "100, 300 512\n40")  # the lengths last: no answer before has a worst step
        shown = poll(page, WORST_SHOWN, lambda w: w["method"] == "exact", 120)
        page.wait_for_timeout(500)  # the formula's searches and curve, asked before, have come back
        screenshot(page, "13-sft-lengths-worst-step.png")
        assert question in posted  # the page's question is the server's words for it, the lengths whole numbers
        assert not any("lengths" in b and (b.get("max_batch_size") or b.get("max_seq_len")) for b in posted)
        status, expected, _ = ask(server, question)
        assert status == 200, expected
        w = expected["worst_step"]
        assert w["documents"] == 4 and shown["documents"] == "4" and shown["fits"] == "true" and not shown["hidden"]
        assert shown["text"] == (f"Worst step of your 4 documents: {w['tokens']:,} tokens, peak "
                                 f"{w['peak_bytes'] / GIB:.2f} GiB allocated, {w['peak_reserved_bytes'] / GIB:.2f} "
                                 f"GiB reserved; fits, {w['headroom_bytes'] / GIB:.2f} GiB of headroom (exact)")
        assert "--packing --lengths lengths.txt" in shown["cli"]
        assert 'lengths=read_lengths("lengths.txt")' in shown["python"]
        assert "lengths=100%2C300%2C512%2C40" in page.url  # the shareable link

        posted.clear()
        page.fill("#lengths", "12, x")
        error = poll(page, "() => document.getElementById('error-lengths').textContent", bool, 10)
        assert error == ('document lengths: "x" is not a whole number of tokens (token counts separated by commas, '
                         "spaces or new lines)")
        assert page.get_attribute("#lengths", "class") == "invalid" and page.is_hidden("#worst-step")
        page.wait_for_timeout(1500)  # past the delays before the formula and the exact answer are asked
        screenshot(page, "14-sft-lengths-not-whole.png")
        assert posted == []
    finally:
        page.remove_listener("request", record)
    assert page.errors == []


def test_grpo_is_asked_with_its_completions_and_answers_the_phase_of_its_peak(page, server):
    """Client grpo on the page (issue 35): its rollout fields appear, the question carries them, the exact answer
    is the command's and names the phase of its peak; the formula's refusal is a note while it waits."""
    question = {"config": TINY_CONFIG, "batch": 8, "seq": 32, "weights_dtype": "bf16", "client": "grpo",
                "optim": "adamw_torch_fused", "checkpointing": True, "gpu": "L4", "num_generations": 4,
                "max_completion_length": 16, "beta": 0.04}
    page.goto(server)
    wait_for_models(page)
    assert not page.is_visible("#num_generations")
    page.check("input[name=source][value=config]")
    page.fill("#config", json.dumps(TINY_CONFIG, indent=2))
    page.fill("#batch", str(question["batch"]))
    page.fill("#seq", str(question["seq"]))
    page.select_option("#adapters", "none")
    page.select_option("#precision", "bf16-autocast")
    page.select_option("#client", "grpo")
    assert page.is_checked("#checkpointing") and page.is_visible("#num_generations")
    page.fill("#num_generations", str(question["num_generations"]))
    page.fill("#max_completion_length", str(question["max_completion_length"]))
    page.fill("#beta", str(question["beta"]))
    page.select_option("#gpu", question["gpu"])
    s = wait_for_answer(page, question, "exact", 180)
    page.wait_for_timeout(300)
    screenshot(page, "10-grpo-exact.png")
    expected = cli_json({**question, "method": "exact"})
    assert expected["client"] == "grpo" and expected["rollout"]["reference_model"]
    check_numbers(s, expected, "the L4")
    shown = page.inner_text("body")
    assert f"peak in the {expected['peak_phase']}" in shown
    assert f"generation {expected['phase_peaks']['generation'] / GIB:.2f} GiB" in shown
    assert page.errors == []


ACCURACY_SHOWN = """() => {
    const line = document.getElementById('setting-accuracy');
    return line ? {text: line.textContent, split: line.dataset.split, points: line.dataset.points} : null;
}"""


def accuracy_words(found: dict, method: str) -> str:
    """The accuracy line the page shows for an answer of `method` on the setting the server found."""
    m = found["methods"][method]
    several = (f"; {found['setting']['layout']} on {' and '.join(map(str, m['gpu_counts']))} GPUs"
               if found["setting"]["num_gpus"] > 1 else "")
    return (f"measured |error| of the peak on this setting ({found['label']}): median {100 * m['median']:.1f}%, "
            f"90th percentile {100 * m['p90']:.1f}%, worst {100 * m['worst']:.1f}% over {m['points']:,} {m['split']} "
            f"GPU peaks ({', '.join(d.removeprefix('NVIDIA ') for d in m['devices'])}{several}); fit verdict right "
            f"for {100 * m['fit_accuracy']:.1f}% of {m['fit_points']} ({found['source']})")


def test_an_sft_user_with_qlora_is_asked_the_commands_question_and_told_its_settings_accuracy(page, server):
    """The issue's user: the page's defaults (precision bf16), then client sft and QLoRA. The page asks what
    `estimate --client sft --weights-dtype bf16` asks (bf16-autocast, not bf16), and the line under the answer
    quotes the held-out SFTTrainer + QLoRA points, not the standard loop's figure."""
    page.goto(server)
    wait_for_models(page)
    page.check("input[name=source][value=model]")
    page.fill("#model", "Qwen2.5-0.5B")
    page.fill("#batch", str(SFT_QLORA["batch"]))
    page.fill("#seq", str(SFT_QLORA["seq"]))
    assert page.input_value("#precision") == "bf16"
    page.select_option("#client", "sft")
    assert page.is_checked("#checkpointing") and page.input_value("#autocast") == "bf16"
    assert page.inner_text("#precision-hint") == "precision bf16-autocast"
    page.select_option("#adapters", "qlora")
    page.select_option("#quantization", SFT_QLORA["quantization"])
    page.fill("#lora_r", str(SFT_QLORA["lora_r"]))
    page.select_option("#gpu", SFT_QLORA["gpu"])
    s = wait_for_answer(page, SFT_QLORA, "exact", 180)
    shown = poll(page, ACCURACY_SHOWN, lambda a: a and a["points"], 30)
    page.wait_for_timeout(300)
    screenshot(page, "08-sft-qlora-exact.png")
    expected = cli_json({**SFT_QLORA, "method": "exact"})  # the command, in the same words
    assert expected["precision"] == "bf16-autocast" and expected["client"] == "sft"
    check_numbers(s, expected, "the RTX 4090")
    assert s["cli"] == cli_text(SFT_QLORA, "exact") and "--precision" not in s["cli"]
    status, found, _ = request(f"{server}/api/setting-accuracy?client=sft&precision=bf16-autocast&lora_r=16"
                               "&quantization=nf4")
    assert status == 200 and found["label"] == "SFTTrainer, QLoRA (nf4), bf16-autocast, one GPU"
    assert (shown["split"], shown["points"]) == ("held-out", "4")  # results/settings_validation.md: 4 held-out points
    assert shown["text"] == accuracy_words(found, "exact")
    assert "2,537" not in page.inner_text("#method")
    assert page.errors == []


def ask_on_the_page(page, question: dict) -> None:
    """The form filled as a person would, for a registry model's question on one or several GPUs."""
    page.check("input[name=source][value=model]")
    page.fill("#model", question["model"])
    page.fill("#batch", str(question["batch"]))
    page.fill("#seq", str(question["seq"]))
    page.select_option("#adapters", "none")
    page.select_option("#precision", question["precision"])
    page.set_checked("#checkpointing", question.get("checkpointing", False))
    page.fill("#num_gpus", str(question.get("num_gpus", 1)))
    page.select_option("#sharding", question.get("sharding", ""))
    if "shard_group" in question:
        page.fill("#shard_group", str(question["shard_group"]))
    page.fill("#tensor_parallel", str(question.get("tensor_parallel", 1)))
    page.select_option("#gpu", question["gpu"])


@pytest.mark.parametrize("question, layout", [
    ({"model": "Qwen/Qwen2.5-0.5B", "batch": 2, "seq": 512, "precision": "fp32", "num_gpus": 16, "sharding": "hsdp",
      "shard_group": 8, "tensor_parallel": 2, "gpu": "L4"}, "hsdp+tp"),
    ({"model": "Qwen/Qwen2.5-0.5B", "batch": 2, "seq": 512, "precision": "bf16", "num_gpus": 4, "sharding": "fsdp",
      "gpu": "L4"}, "fsdp"),
], ids=["never-measured", "fsdp"])
def test_several_gpus_quote_the_measured_rows_of_their_layout_or_say_none_match(page, server, question, layout):
    """The line under a several-GPU answer names the layout and quotes the validation's rows of it (the GPU counts
    they ran on), or says plainly that none is measured."""
    page.goto(server)
    wait_for_models(page)
    ask_on_the_page(page, question)
    wait_for_answer(page, question, "exact", 120)
    shown = poll(page, ACCURACY_SHOWN, lambda a: a and "GPUs" in a["text"], 30)
    query = "&".join(f"{k}={question[k]}" for k in ("precision", "num_gpus", "sharding") if k in question)
    query += f"&tensor_parallel={question.get('tensor_parallel', 1)}"
    status, found, _ = request(f"{server}/api/setting-accuracy?{query}")
    assert status == 200 and found["setting"]["layout"] == layout
    assert found["label"].endswith(f"{question['num_gpus']} GPUs, {layout}")
    if found["methods"]:  # once the validation holds several-GPU rows of the layout
        assert shown["text"] == accuracy_words(found, "exact") and shown["points"]
    else:
        assert shown["points"] == ""
        assert shown["text"] == f"measured accuracy: {found['missing']}"
    assert page.errors == []


LAYOUTS_SHOWN = """() => {
    const v = (id) => document.getElementById(id);
    const table = v('layouts-table');
    return {method: table.dataset.method, summary: v('layouts-summary').textContent, cli: v('layouts-cli').textContent,
            error: v('layouts-error').textContent, caption: v('layouts-caption').textContent,
            rows: [...table.tBodies[0].rows].map((r) => ({layout: r.dataset.layout, fits: r.dataset.fits,
                best: r.classList.contains('best'), peak: r.cells[1].dataset.bytes || null,
                reserved: r.cells[2].dataset.bytes || null, cells: [...r.cells].map((c) => c.textContent)}))};
}"""


STREAMING = """() => {
    const rows = [...document.getElementById('layouts-table').tBodies[0].rows];
    return {exact: rows.filter((r) => r.dataset.method === 'exact').length,
            formula: rows.filter((r) => r.dataset.method === 'formula').length,
            method: document.getElementById('layouts-table').dataset.method,
            status: document.getElementById('layouts-status').textContent};
}"""


def check_layouts(shown: dict, expected: dict) -> None:
    """The page's table (`shown`) is the command's `--layouts` / `--min-gpus` JSON row by row."""
    assert shown["method"] == expected["method"]
    assert [r["layout"] for r in shown["rows"]] == [r["layout"] for r in expected["layouts"]]
    for row, want in zip(shown["rows"], expected["layouts"]):
        assert row["fits"] == json.dumps(want["fits"])
        if want.get("peak_bytes") is None:
            assert (row["peak"], row["cells"][1:4]) == (None, ["–", "–", "no" if want["fits"] is False else "?"])
        else:
            assert float(row["peak"]) == want["peak_bytes"] and float(row["reserved"]) == want["peak_reserved_bytes"]
            headroom = want["headroom_bytes"] / GIB
            assert row["cells"][3] == (f"yes, {headroom:.2f} GiB headroom" if want["fits"]
                                       else f"no, {-headroom:.2f} GiB short")
        assert row["cells"][4] == want.get("reason", "")
        assert row["best"] == (expected.get("layout") is not None and expected["layout"]["layout"] == want["layout"])


def test_the_layouts_and_the_fewest_gpus_of_a_several_gpu_question(page, server):
    """Layouts on 1 to 4 GPUs (the GPUs asked), the formula's table at once and the exact rows streamed in over it
    as each simulation ends, with the progress said; each table the command's; ddp does not fit where fsdp does. Then the fewest GPUs: "2 GPUs: fsdp", and the rows it tried."""
    page.goto(server)
    wait_for_models(page)
    ask_on_the_page(page, SEVERAL)
    wait_for_answer(page, SEVERAL, "formula", 30)
    assert page.inner_text("#layouts-run") == "Layouts on 1 to 4 GPUs"
    page.click("#layouts-run")
    asked = {**{k: v for k, v in SEVERAL.items() if k != "sharding"}, "layouts": True}
    formula = poll(page, LAYOUTS_SHOWN, lambda s: s["method"] == "formula", 30)
    assert formula["cli"] == cli_text(asked, "formula")
    # the exact rows stream in (/api/layouts), each replacing the formula's of its layout, the progress said
    streaming = poll(page, STREAMING, lambda s: s["exact"] > 0 and s["formula"] > 0, 300)
    assert re.fullmatch(r"exact: \d+ of 10 layouts simulated \(the rest are the formula's\)… \d+ s", streaming["status"])
    assert streaming["method"] == "formula"  # the table's answer is the formula's until the last exact row
    exact = poll(page, LAYOUTS_SHOWN, lambda s: s["method"] == "exact", 300)
    assert poll(page, STREAMING, lambda s: s["exact"] == 10, 5)["status"] == ""
    page.wait_for_timeout(300)
    screenshot(page, "09-layouts-exact.png")
    layouts = page.locator("#layouts").bounding_box()
    page.screenshot(path=str(ARTIFACTS / "09-layouts-exact-clip.png"), full_page=True,
                    clip={"x": 0, "y": 0, "width": 1400, "height": layouts["y"] + layouts["height"] + 16})
    assert exact["cli"] == cli_text(asked, "exact")
    check_layouts(formula, cli_json({**asked, "method": "formula"}))
    expected = cli_json({**asked, "method": "exact"})
    check_layouts(exact, expected)
    rows = {row["layout"]: row for row in expected["layouts"]}
    for ddp in ("1 GPU", "2 GPUs, ddp", "4 GPUs, ddp"):
        assert rows[ddp]["fits"] is False
    assert rows["2 GPUs, fsdp"]["fits"] is True and rows["4 GPUs, fsdp"]["fits"] is True
    fitting = [row for row in expected["layouts"] if row["fits"]]
    assert exact["summary"] == (f"{len(fitting)} of {len(expected['layouts'])} layouts fit; the fewest GPUs that do: "
                                "2 (exact)")

    page.click("#min-gpus-run")
    fewest_asked = {**{k: v for k, v in asked.items() if k != "layouts"}, "num_gpus": 1024, "min_gpus": True}
    fewest = poll(page, LAYOUTS_SHOWN, lambda s: s["method"] == "formula" and "--min-gpus" in s["cli"], 30)
    page.wait_for_timeout(300)
    screenshot(page, "10-fewest-gpus-formula.png")
    assert fewest["cli"] == cli_text(fewest_asked, "formula")
    expected = cli_json({**fewest_asked, "method": "formula"})
    check_layouts(fewest, expected)
    assert expected["min_gpus"] == 2 and expected["layout"]["layout"] == "2 GPUs, fsdp"
    assert fewest["summary"] == f"2 GPUs: fsdp, {expected['layout']['headroom_bytes'] / GIB:.2f} GiB of headroom " \
                                "per GPU (formula)"
    assert page.errors == []


def test_a_bad_config_is_a_message_beside_the_field(page, server):
    page.goto(server)
    wait_for_models(page)
    page.check("input[name=source][value=config]")
    bad = {"model_type": "no_such_architecture", "hidden_size": 64}
    page.fill("#config", json.dumps(bad))
    page.select_option("#gpu", "T4")
    question = {"config": bad, "batch": int(page.input_value("#batch")), "seq": int(page.input_value("#seq")),
                "precision": "bf16", "gpu": "T4", "method": "exact"}
    status, answer, _ = ask(server, question)
    assert status == 400
    poll(page, "() => document.getElementById('error-config').textContent", lambda t: t == answer["error"], 120)
    assert page.get_attribute("#config", "class") == "invalid"
    assert page.get_attribute("#verdict", "data-fits") == ""
    screenshot(page, "05-bad-config.png")
    assert "Traceback" not in page.inner_text("body")

    page.fill("#config", "{not json")
    poll(page, "() => document.getElementById('error-config').textContent", lambda t: t.startswith("not valid JSON"), 10)
    screenshot(page, "06-config-not-json.png")
    assert page.errors == []


def test_an_accelerate_config_file_is_read_as_the_command_reads_it(page, server, tmp_path):
    """The Trainer on the YAML `accelerate config` writes (FSDP2, 4 processes), uploaded with the file picker: the
    page's question is the command's with that file, and so are its numbers."""
    import yaml

    question = {"model": "HuggingFaceTB/SmolLM2-135M", "batch": 4, "seq": 1024, "precision": "amp-bf16",
                "client": "trainer", "optim": "adamw_torch_fused", "accelerate_config": yaml.safe_load(ACCELERATE_YAML),
                "gpu": "T4"}
    page.goto(server)
    wait_for_models(page)
    ask_on_the_page(page, {**question, "precision": "bf16"})
    page.select_option("#client", "trainer")
    page.select_option("#weights_dtype", "fp32")
    page.select_option("#autocast", "bf16")
    page.click("#accelerate-box summary")
    (tmp_path / "default_config.yaml").write_text(ACCELERATE_YAML)
    page.set_input_files("#accelerate-file", str(tmp_path / "default_config.yaml"))
    s = wait_for_answer(page, question, "formula", 30)
    expected = cli_json({**question, "method": "formula"})
    assert (expected["num_gpus"], expected["sharding"], expected["precision"]) == (4, "fsdp", "amp-bf16")
    check_numbers(s, expected, "the T4, each GPU of 4 GPUs, fsdp")
    screenshot(page, "11-accelerate-config.png")
    assert page.errors == []


def test_an_axolotl_file_is_asked_as_the_command_asks_it(page, server):
    """A person with an Axolotl file (issue 36): the page takes the file as it is (lists and all: the server parses
    its YAML), asks only the GPU beside it, and answers what `estimate --axolotl-config FILE` answers; the copied
    command names the file."""
    from conftest import pipeline

    path = REPO / "tests/data/frameworks/axolotl_lora.yaml"
    page.goto(server)
    wait_for_models(page)
    assert not page.is_visible("#framework_file")
    page.check("input[name=source][value=framework]")
    assert not page.is_visible("#batch")  # the file's, not asked
    page.fill("#framework_file", path.read_text())
    page.select_option("#gpu", "L4")
    cli = "python -m pipeline estimate --gpu L4 --axolotl-config axolotl.yaml --method exact --json"
    s = poll(page, SHOWN, lambda s: s["cli"] == cli and s["method_shown"] == "exact", 240)
    expected = json.loads(pipeline("estimate", "--axolotl-config", str(path), "--gpu", "L4", "--method", "exact",
                                   "--json", cwd=REPO).stdout)
    assert (expected["model_id"], expected["batch_size"], expected["seq_len"]) == ("Qwen/Qwen2.5-0.5B", 2, 1024)
    check_numbers(s, expected, "the L4")
    assert "from_pretrained" not in page.inner_text("#python")  # the call names the file, not a model
    assert 'axolotl_config="axolotl.yaml"' in page.inner_text("#python")
    screenshot(page, "12-axolotl-file.png")
    assert page.errors == []
