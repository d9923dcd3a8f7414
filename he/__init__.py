"""he: encrypted inference for polynomial networks with CKKS (TenSEAL / SEAL).

    prog = he.compile(model, example_input, calibration=x_cal, packing="vector")  # or "batch",
                                                          # "tokens", "auto"
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x)))

Names are exported lazily (module ``__getattr__``): ``he.Server`` imports the runtime on first use
and never torch, so a process that only runs ciphertexts starts without it; ``he.compile`` reads a
PyTorch model and imports torch when it is called.
"""

from __future__ import annotations

from polynets._lazy import export_lazily

__all__ = export_lazily(__name__, {
    "he.compiler": "compile load_program CompiledProgram PACKINGS",
    "he.client": "Client Server Ciphertext",
    "he.tokens": "TokenPlan",
    "he.params": "CKKSParams choose_params",
    "he.report": "report Report StepProfile",
    "he.errors": "HEError NotEncryptableError TooDeepError ParameterError InputShapeError "
                 "SerializationError KeyMismatchError SecretKeyError ResourceError "
                 "CalibrationRangeWarning MemoryBudgetWarning",
})
