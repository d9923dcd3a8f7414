"""Training: the trainer (:mod:`.train`), data sets (:mod:`.data`), checkpoints
(:mod:`.checkpoint`), device selection (:mod:`.device`) and plots of runs (:mod:`.plot`).

Nothing is imported here: ``polynets.Trainer`` and friends load their module on first use.
"""
