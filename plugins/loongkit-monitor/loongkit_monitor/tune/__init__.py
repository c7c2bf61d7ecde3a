"""``loongkit tune -- <training command>``: run the job briefly under candidate LOONGKIT_* settings and
rank them by the training monitor's mean warm step.

One job per module:

* :mod:`.facts` - what applies on this machine (``loongkit features --json``, ``doctor``, ``numa plan``);
* :mod:`.space` - the candidate settings, ordered by the baseline trial's monitor figures;
* :mod:`.figures` - the monitor's figures read from a trial's JSON Summary;
* :mod:`.trial` - one trial: a fresh process, bounded steps, timeout, losses from its output;
* :mod:`.budget` - the time budget, the next trial's predicted cost, the progress bar;
* :mod:`.ranking` - attempts folded per candidate, exclusions, noise, the winner;
* :mod:`.search` - the schedule: baseline, one round, successive halving, repeats of the leaders;
* :mod:`.report` - the ranked table, paste-ready lines, JSON and PNG;
* :mod:`.cli` - the ``loongkit tune`` subcommand;
* :mod:`.workers` / :mod:`.registration` - LOONGKIT_DATALOADER_WORKERS, the worker-count knob tune turns.

Nothing here is imported when the plugin is loaded except :mod:`.registration` (no torch).
"""
