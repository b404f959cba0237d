"""The GPU catalogue: the 2025-26 cards' nvidia-smi totals, their names, and a verdict made against them."""

from __future__ import annotations

import pytest

from pipeline.estimate import estimate
from pipeline.formulas.gpus import DEVICES, MIB, _normal, device, outside_bytes

# nvidia-smi "Memory-Usage" totals (MiB), as found in public nvidia-smi outputs.
NEW_CARDS = {
    "GB200": 189_471, "B200": 183_359, "GH200 144GB": 146_831, "GH200 96GB": 97_871, "H20": 97_871,
    "H100 NVL": 95_830, "H800": 81_559, "A800 80GB": 81_920, "RTX PRO 6000": 97_887, "RTX 6000 Ada": 49_140,
    "RTX A6000": 49_140, "RTX 5090": 32_607, "RTX 5080": 16_303, "RTX 4080 SUPER": 16_376, "RTX 4080": 16_376,
}


def test_new_cards_and_their_totals():
    assert {name: DEVICES[name].total_mib for name in NEW_CARDS} == NEW_CARDS
    assert all(DEVICES[name].source.startswith(("nvidia-smi", "one nvidia-smi")) for name in NEW_CARDS)
    names = [_normal(name) for name in DEVICES]
    assert len(set(names)) == len(names)  # unique after case and spaces are ignored


@pytest.mark.parametrize("smi_name, name", [
    ("NVIDIA GeForce RTX 5090", "RTX 5090"), ("nvidia b200", "B200"), ("H100 NVL", "H100 NVL"),
    ("rtx 4080", "RTX 4080"), ("RTX 4080 SUPER", "RTX 4080 SUPER"), ("rtx pro 6000", "RTX PRO 6000"),
])
def test_names_as_nvidia_smi_writes_them(smi_name, name):
    assert device(smi_name) is DEVICES[name]


@pytest.mark.parametrize("gpu, fits", [("RTX 5090", True), ("RTX 5080", False)])
def test_verdict_against_the_new_totals(gpu, fits):
    """Qwen2.5-0.5B, bf16, B=4, L=1024 reserves about 16.2 GiB: it fits the 5090's 32,607 MiB, not the 5080's
    16,303 MiB."""
    answer = estimate(model="Qwen/Qwen2.5-0.5B", batch=4, seq=1024, precision="bf16", method="formula", gpu=gpu)
    total = NEW_CARDS[gpu] * MIB
    assert (answer["gpu"], answer["device_total_bytes"]) == (gpu, total)
    assert answer["outside_bytes"] == outside_bytes(DEVICES[gpu], "bf16")
    assert answer["headroom_bytes"] == pytest.approx(total - answer["peak_reserved_bytes"] - answer["outside_bytes"])
    assert answer["fits"] is fits
