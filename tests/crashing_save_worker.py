"""The real CLI, killed (SIGKILL) at one filesystem step of its second checkpoint save.

    python tests/crashing_save_worker.py replace|rmtree NTH [train flags ...]

The process dies just before the NTH call of os.replace (or shutil.rmtree) inside the
second save, as a power cut or the OOM killer would stop it there.
"""

import os
import shutil
import signal
import sys

import fsdp_lesson.checkpoint as checkpoint
import fsdp_lesson.train as train
from fsdp_lesson.__main__ import main

kind, nth = sys.argv[1], int(sys.argv[2])
saves, calls = [0], {"replace": 0, "rmtree": 0}


def dies_before(name, real):
    def call(*args, **kwargs):
        if saves[0] == 2:
            calls[name] += 1
            if name == kind and calls[name] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    return call


def counting(save):
    def call(*args, **kwargs):
        saves[0] += 1
        return save(*args, **kwargs)

    return call


checkpoint.os.replace = dies_before("replace", os.replace)
checkpoint.shutil.rmtree = dies_before("rmtree", shutil.rmtree)
train.save_checkpoint = counting(train.save_checkpoint)
sys.exit(main(["train", *sys.argv[3:]]))
