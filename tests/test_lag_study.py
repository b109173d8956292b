"""The lag-study launcher, CI-sized: every method at two lags, its report and plots."""

import os

import pytest

from oapl_jax.studies import lag_study


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("lag_study"))
  assert lag_study.main(["--out", out, "--reduced", "--lags", "1", "2", "--seeds", "0"]) == 0
  return out


def test_runs_every_method_and_lag_from_one_base(study):
  runs = lag_study.load_runs(study)
  assert sorted((r.method, r.lag) for r in runs) == sorted(
      (m, l) for m in lag_study.METHODS for l in (1, 2))
  assert len(os.listdir(os.path.join(study, "base_models"))) == 1  # one warm-up for the seed
  befores = {str(r.summary["eval_before"]) for r in runs}
  assert len(befores) == 1  # every method starts from the same base and is evaluated the same way
  for r in runs:
    cfg = r.summary["config"]
    assert cfg["rl"]["lag"] == r.lag and cfg["seed"] == 0
    assert cfg["rl"]["loss"] == lag_study.METHODS[r.method][1]["rl.loss"]
    assert r.summary["samples_generated"] == runs[0].summary["samples_generated"]  # equal budgets
    x, y = r.pass1_curve()
    assert x[0] == 0 and x[-1] == r.summary["samples_generated"] and len(x) == len(y) >= 3
  assert {r.summary["config"]["rl"]["beta2"] for r in runs if r.method == "oapl_paper_betas"} == {1e-3}


def test_report_has_table_plots_findings_and_keeps_notes(study):
  report = os.path.join(study, "report.md")
  lag_study.write_report(study, report, command="python -m oapl_jax.studies.lag_study --reduced")
  text = open(report).read()
  assert "python -m oapl_jax.studies.lag_study --reduced" in text
  for label, _ in lag_study.METHODS.values():
    assert text.count(f"| {label} |") == 2  # one table row per lag
  for png in ("pass1_vs_samples.png", "entropy_vs_step.png", "passk_before_after.png"):
    path = os.path.join(study, "report", png)
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"(report/{png})" in text
  assert "pass@k after >= before" in text and "entropy," in text and "pass@1 after, L=2" in text
  # a hand-written reading survives regeneration
  text = text.replace("_(no notes yet)_", "My reading.")
  open(report, "w").write(text)
  lag_study.write_report(study, report, command="again")
  assert "My reading." in open(report).read()


def test_finished_runs_are_skipped(study, capsys):
  lag_study.run_study(study, methods=("oapl",), lags=(1,), seeds=(0,), reduced=True)
  assert "done already" in capsys.readouterr().out


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="unknown method"):
    lag_study.study_config("ppo", 1, 0)
  with pytest.raises(SystemExit):
    lag_study.main(["--out", "/tmp/x", "--lags", "0"])
