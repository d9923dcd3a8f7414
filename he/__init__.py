"""he: encrypted inference for polynomial networks with CKKS (TenSEAL / SEAL).

    prog = he.compile(model, example_input, calibration=x_cal, packing="vector")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x)))
"""

from he.client import Ciphertext, Client, Server
from he.compiler import PACKINGS, CompiledProgram, compile, load_program
from he.errors import (CalibrationRangeWarning, HEError, InputShapeError, KeyMismatchError,
                       NotEncryptableError, ParameterError, SecretKeyError, SerializationError,
                       TooDeepError)
from he.params import CKKSParams, choose_params
from he.report import Report, report

__all__ = ["compile", "load_program", "CompiledProgram", "Client", "Server", "Ciphertext",
           "CKKSParams", "choose_params", "report", "Report", "PACKINGS", "HEError",
           "NotEncryptableError", "TooDeepError", "ParameterError", "InputShapeError",
           "SerializationError", "KeyMismatchError", "SecretKeyError", "CalibrationRangeWarning"]
