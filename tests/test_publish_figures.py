"""The figures, drawn from real stage outputs: valid PNGs with real content; a figure whose
table is absent is skipped with a note."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from conftest import COMMITTED_PEAKS, pipeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The real stages (configs, activations, fit, validate, figures) run once for the session: ~1-2 min.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(staged_results) -> Path:
    return staged_results


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]  # header chunk intact
    return width, height


def distinct_colours(path: Path) -> int:
    from matplotlib import image

    pixels = image.imread(path)
    return len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].round(2).tolist()})


def test_figures_are_valid_pngs_with_content(results):
    from pipeline.publish.figures import expected_figures

    names = expected_figures(p.name for p in results.iterdir())
    assert {"activations_vs_parameters", "residuals_by_family", "saved_bytes_vs_seq_len"} <= set(names)
    if COMMITTED_PEAKS.exists():
        assert {"predicted_vs_measured", "peak_vs_tokens"} <= set(names)
    for name in names:
        path = results / "figures" / f"{name}.png"
        width, height = png_size(path)
        assert width >= 400 and height >= 300, name
        assert path.stat().st_size > 20_000, name
        assert distinct_colours(path) > 20, name  # points, lines and text, not a blank canvas


def test_activations_figure_shows_every_family_and_both_lines(results):
    import matplotlib

    matplotlib.use("Agg")
    from pipeline.publish.figures import draw_activations_vs_parameters, hook_points

    import json

    figure = draw_activations_vs_parameters(results)
    ax = figure.axes[0]
    labels = [text.get_text() for legend in [*ax.artists, ax.get_legend()] for text in legend.get_texts()]
    points = hook_points(results, json.loads((results / "coefficients.json").read_text()))
    assert set(points["family"]) <= set(labels)
    assert any(label.startswith("refit (") and "A = " in label for label in labels)
    assert any("fp32 bytes ÷ 4 = elements" in label for label in labels)
    plotted = sum(len(c.get_offsets()) for c in ax.collections if c.get_label() in set(points["family"]))
    assert plotted == len(points) == 4


def test_a_figure_without_its_table_is_skipped_with_a_note(results, tmp_path):
    import shutil

    partial = tmp_path / "results"
    partial.mkdir()
    for name in ("models.parquet", "activations.parquet"):
        shutil.copyfile(results / name, partial / name)
    run = pipeline("figures", "--results", partial, "--out", partial / "figures", cwd=tmp_path)
    assert "saved_bytes_vs_seq_len: " + str(partial / "figures" / "saved_bytes_vs_seq_len.png") in run.stdout
    assert f"activations_vs_parameters: skipped: {partial / 'coefficients.json'} absent" in run.stdout
    assert f"peak_vs_tokens: skipped: {partial / 'peak_memory.parquet'} absent" in run.stdout
    assert sorted(p.name for p in (partial / "figures").iterdir()) == ["saved_bytes_vs_seq_len.png"]


def test_trainer_vs_sft_figure_draws_its_three_series(tmp_path):
    """The README's figure of issue 20 from an SFT table's rows (here the simulator's peaks of Qwen2.5-0.5B,
    B=4, bf16-autocast, standing in for the H100 rows that config/sweep_sft.yaml measures)."""
    import pandas as pd

    from pipeline.publish.figures import draw_figures

    gib = 2**30
    rows = []
    for client, checkpointing, lora, peaks in (("trainer", False, None, {1024: 15.08, 2048: 27.31}),
                                               ("sft", True, None, {1024: 4.07, 2048: 4.36}),
                                               ("sft", True, 16, {1024: 1.63, 2048: 2.18})):
        for seq, peak in peaks.items():
            rows.append(dict(model_id="Qwen/Qwen2.5-0.5B", status="ok", precision="bf16-autocast", client=client,
                             gradient_checkpointing=checkpointing, lora_r=lora, lora_targets="all-linear" if lora else None,
                             liger_kernel=False, completion_share=1.0, gradient_accumulation=1, batch_size=4,
                             seq_len=seq, peak_allocated_bytes=int(peak * gib)))
    table = tmp_path / "results" / "sft" / "h100" / "peak_memory.parquet"
    table.parent.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(table)
    drawn = draw_figures(tmp_path / "results", tmp_path / "figures", only=["trainer_vs_sft"])
    path = Path(drawn["trainer_vs_sft"])
    width, height = png_size(path)
    assert width >= 400 and height >= 300 and distinct_colours(path) > 20
