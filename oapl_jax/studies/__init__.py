"""Experiments built from the public API (runs, reports, plots): the lag study, a file a concern.

    definitions.py  what is run: methods, lags, seeds, the two tasks, each run's config
    search.py       the settings search, pure: each method's grid, the runs' order, the choice
    layout.py       where a study's files lie under its folder and under a results folder
    runner.py       the budgeted, resumable runs (the search, then the study)
    results.py      finished runs read back, from their folders or committed small results
    stats.py        pure statistics: pass@k, mean ± sd per (method, lag), paired t-intervals,
                    a run's fallen refresh windows, mean of its last evaluations, area
    plots.py        the matplotlib figures
    report.py       the markdown report, a pure function of the results, and its findings
    verdicts.py     the paper's findings restated as claims, each with a verdict from the runs
    predictions.py  the mixed-task study's registered predictions, checked the same way
    lag_study.py    the command (`python -m oapl_jax.studies.lag_study`) and `write_report`
    reachable.py    the registered reachable-targets experiment, its own command and report

A command layer: it imports oapl_jax.config, oapl_jax.train and below; nothing else in oapl_jax
imports it.
"""
