"""The A/B harness (``bench/ab.py``): settings checked before any run, rounds in ABBA order,
medians, spreads and differences from what each run wrote."""

from __future__ import annotations

import json
import random
import sys
import textwrap

import pytest

from deepinfer_fx.bench import ab

# A stand-in for p8_vs_hf: a decode row whose time depends on the variant's DEEPINFER_PDL and on
# a per-run jitter the test draws, and a prefill row; it also logs the order it ran in.
_FAKE_BENCH = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    jitter = json.loads(os.environ["AB_TEST_JITTER"])
    log = Path(os.environ["AB_TEST_LOG"])
    n = len(log.read_text().split()) if log.exists() else 0
    log.write_text((log.read_text() if log.exists() else "") + os.environ.get("DEEPINFER_PDL", "-") + " ")
    if "--fail" in sys.argv:
        print("boom: no GPU here"); sys.exit(3)
    ms = (2.0 if os.environ.get("DEEPINFER_PDL") == "1" else 2.2) + jitter[n]
    (out / "p8_vs_hf_decode.json").write_text(json.dumps({
        "decode": [{"batch": 1, "context": 512, "ours_ms": ms}],
        "prefill": [{"tokens": 4096, "ours_ms": 50.0 + jitter[n]}]}))
""")


@pytest.fixture
def fake_bench(tmp_path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    (tmp_path / "fake_p8_bench.py").write_text(_FAKE_BENCH)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    monkeypatch.setenv("AB_TEST_LOG", str(tmp_path / "order.txt"))
    jitter = [random.uniform(-0.005, 0.005) for _ in range(8)]
    monkeypatch.setenv("AB_TEST_JITTER", json.dumps(jitter))
    return jitter


def test_rounds_run_abba_and_the_summary_is_medians_and_differences(tmp_path, fake_bench: list[float]) -> None:
    out = tmp_path / "results"
    result = ab.main(
        [
            "--variant",
            "off",
            "--variant",
            "on DEEPINFER_PDL=1",
            "--rounds",
            "4",
            "--bench",
            "fake_p8_bench",
            "--name",
            "pdl_ab",
            "--out",
            str(out),
            "--",
            "--steps",
            "3",
        ]
    )
    assert (tmp_path / "order.txt").read_text().split() == ["-", "1", "1", "-", "-", "1", "1", "-"]
    assert result["order"] == [
        (0, "off"),
        (0, "on"),
        (1, "on"),
        (1, "off"),
        (2, "off"),
        (2, "on"),
        (3, "on"),
        (3, "off"),
    ]
    off_runs, on_runs = [0, 3, 4, 7], [1, 2, 5, 6]
    decode = result["summary"]["decode b1 ctx512 ms"]
    assert decode["off"]["values"] == pytest.approx([2.2 + fake_bench[i] for i in off_runs])
    median_off = sorted(2.2 + fake_bench[i] for i in off_runs)[1:3]
    median_on = sorted(2.0 + fake_bench[i] for i in on_runs)[1:3]
    assert decode["off"]["median"] == pytest.approx(sum(median_off) / 2)
    assert decode["on"]["vs_off"] == pytest.approx(sum(median_on) / 2 - sum(median_off) / 2, abs=1e-4)
    assert decode["on"]["resolved"]  # 0.2 ms apart, rounds within 0.01
    assert not result["summary"]["prefill 4096 ms"]["on"]["resolved"]  # same figure, jitter only
    saved = json.loads((out / "pdl_ab.json").read_text())
    assert saved["variants"] == {"off": {}, "on": {"DEEPINFER_PDL": "1"}} and saved["bench_args"] == ["--steps", "3"]
    assert len(saved["runs"]) == 8 and saved["runs"][1]["result"]["decode"][0]["ours_ms"] == pytest.approx(
        2.0 + fake_bench[1]
    )


def test_one_round_resolves_nothing(tmp_path, fake_bench: list[float]) -> None:
    result = ab.main(
        [
            "--variant",
            "off",
            "--variant",
            "on DEEPINFER_PDL=1",
            "--rounds",
            "1",
            "--bench",
            "fake_p8_bench",
            "--out",
            str(tmp_path),
        ]
    )
    decode = result["summary"]["decode b1 ctx512 ms"]
    assert decode["on"]["vs_off"] == pytest.approx(-0.2 + fake_bench[1] - fake_bench[0], abs=1e-4)
    assert decode["off"]["spread"] == 0 and not decode["on"]["resolved"]


def test_a_failed_run_ends_with_its_output(tmp_path, fake_bench: list[float]) -> None:
    with pytest.raises(RuntimeError, match="(?s)exited with 3 .*boom: no GPU here"):
        ab.main(
            [
                "--variant",
                "a",
                "--variant",
                "b DEEPINFER_PDL=1",
                "--bench",
                "fake_p8_bench",
                "--out",
                str(tmp_path),
                "--",
                "--fail",
            ]
        )


def test_a_tree_variant_runs_that_trees_bench(tmp_path, fake_bench: list[float]) -> None:
    """``TREE=DIR`` puts DIR first on the path and runs there: its bench, not this one's."""
    tree = tmp_path / "other_commit"
    (tree / "deepinfer_fx").mkdir(parents=True)
    (tree / "fake_p8_bench.py").write_text(
        _FAKE_BENCH.replace("2.0 if", "1.5 if").replace(
            "jitter[n]\n", "jitter[n]\nassert Path.cwd() == Path(__file__).parent\n", 1
        )
    )
    result = ab.main(
        [
            "--variant",
            "here DEEPINFER_PDL=1",
            "--variant",
            f"there DEEPINFER_PDL=1 TREE={tree}",
            "--rounds",
            "2",
            "--bench",
            "fake_p8_bench",
            "--out",
            str(tmp_path / "results"),
        ]
    )
    decode = result["summary"]["decode b1 ctx512 ms"]
    assert decode["there"]["vs_here"] == pytest.approx(-0.5, abs=0.02) and decode["there"]["resolved"]
    assert result["variants"]["there"] == {"DEEPINFER_PDL": "1", "TREE": str(tree.resolve())}


@pytest.mark.parametrize(
    "variants, message",
    [
        (["a DEEPINFER_PDL=maybe", "b"], "DEEPINFER_PDL='maybe' is invalid: expected 0 or 1"),
        (["a DEEPINFER_PLD=1", "b"], "DEEPINFER_PLD is not a deepinfer_fx setting"),
        (["a CUDA_VISIBLE_DEVICES=1", "b"], "neither a DEEPINFER_"),
        (["a DEEPINFER_PDL", "b"], "is not KEY=VALUE"),
        (["a TREE=/no/such/tree", "b"], "holds no deepinfer_fx package"),
        (["a", "a DEEPINFER_PDL=1"], "distinct names"),
        (["a"], "at least two"),
        (["DEEPINFER_PDL=1", "b"], "the first word is its name"),
    ],
)
def test_bad_variants_are_refused_before_any_run(
    variants: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [x for v in variants for x in ("--variant", v)] + ["--bench", "no_such_bench_module"]
    with pytest.raises(SystemExit):
        ab.main(argv)
    assert message in capsys.readouterr().err
