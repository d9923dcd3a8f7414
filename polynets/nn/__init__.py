"""Layers and models: the Mu-Layer and Poly-Block (:mod:`.layers`), the Polynomial Mixer
(:mod:`.pom`), PADRe and the other polynomial mixers (:mod:`.padre`), pair inputs (:mod:`.pair`),
Poly-NODEs (:mod:`.node`) and the model families registered in timm (:mod:`.models`).

Nothing is imported here: ``polynets.MuLayer`` and friends load their module on first use.
"""
