"""The polynomial program and its passes: the IR (:mod:`.program`, with its torch evaluation in
:mod:`._program_torch`), tracing a model into it (:mod:`.trace`), folding and simplifying
(:mod:`.passes`), the certificate (:mod:`.certify`) and the lowering to affine steps between
ciphertext products that certify and the CKKS compiler share (:mod:`.lowering`).

Nothing is imported here: ``polynets.trace`` and friends load their module on first use.
"""
