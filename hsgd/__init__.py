"""hsgd: hybrid-parallel SGD for GPT-style Transformers, written out in NumPy/CuPy and mpi4py.

    hsgd.ModelConfig        the model's shape (config.py)
    hsgd.serial             the serial reference model: init_params, loss_and_grads (serial.py)
    hsgd.layers             forward/backward pairs of every layer (layers.py)
    hsgd.data               the corpus, the train/validation split and the batch of each step (data.py)
    hsgd.train              the training entry point: python -m hsgd.train --help
"""
from . import serial
from .config import ModelConfig

__all__ = ["ModelConfig", "serial"]
__version__ = "0.1.0"
