"""DeepSpeed's CPU ops the tests load: built once by conftest.py before the tests start, loaded by every rank's fork
server (rank_preload.py). Only the shared-memory collectives, which DeepSpeed's comm builds at every init: fp8dist
asks for torch's AdamW on a CPU (strategies/deepspeed.py ``torch_adam_on_cpu``), so FusedAdam is never built."""

DS_OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm"}
