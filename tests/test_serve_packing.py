"""`python -m pipeline serve` takes TRL's packed batches as `estimate` does (`packing`, `padding_free`, `lengths`):
a real uvicorn server on localhost answers a packed SFT step from the simulator (above the same step unpacked:
SDPA's packed-sequence mask), adds a dataset's worst step for its document lengths, and refuses bad values with
HTTP 400 and one line."""

from __future__ import annotations

import pytest
from serve_support import ask, running_server

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SMALL = "HuggingFaceTB/SmolLM2-135M"
PACKED = {"model": SMALL, "client": "sft", "batch": 2, "seq": 512, "packing": True, "method": "exact",
          "gpu": "H100 80GB"}
LENGTHS = [100, 300, 512, 40]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-packing") / "server.log") as url:
        yield url


def answer_of(server, question):
    status, body, _ = ask(server, question)
    assert status == 200, body
    return body


@pytest.mark.slow
def test_a_packed_step_and_its_datasets_worst_step(server):
    packed = answer_of(server, PACKED)
    assert packed["packing"] is True and packed["padding_free"] is True and packed["method"] == "exact"
    unpacked = answer_of(server, {k: v for k, v in PACKED.items() if k != "packing"})
    assert "packing" not in unpacked
    # the same B x L tokens, plus SDPA's (N, N) packed-sequence mask and what each layer saves of it
    assert packed["peak_bytes"] > unpacked["peak_bytes"]

    with_lengths = answer_of(server, {**PACKED, "lengths": LENGTHS})
    assert with_lengths["peak_bytes"] == packed["peak_bytes"]  # the question's own step is unchanged
    worst = with_lengths["worst_step"]
    assert worst["documents"] == len(LENGTHS) and 0 < worst["tokens"] <= PACKED["batch"] * PACKED["seq"]
    assert 0 < worst["peak_bytes"] <= with_lengths["peak_bytes"]
    assert worst["fits"] is True
    assert any("worst step" in note for note in with_lengths["notes"])


BAD = [
    ({**PACKED, "packing": "yes"}, "packing must be true or false"),
    ({**PACKED, "padding_free": 1}, "padding_free must be true or false"),
    ({**PACKED, "lengths": []}, "lengths must list from 1"),
    ({**PACKED, "lengths": [0]}, "whole number from 1"),
    ({**PACKED, "lengths": "100,300"}, "lengths must be a JSON list"),
    ({**PACKED, "lengths": LENGTHS, "layouts": True}, "lengths is not taken with layouts"),
    ({**PACKED, "client": "trainer", "precision": "amp-bf16"}, "SFTTrainer"),
]


@pytest.mark.parametrize("body,words", BAD, ids=[w for _, w in BAD])
def test_bad_packing_input_is_a_400_with_one_line(server, body, words):
    status, answer, text = ask(server, body)
    assert status == 400, answer
    assert set(answer) == {"error"} and words.lower() in answer["error"].lower()
    assert "\n" not in answer["error"] and "Traceback" not in text
