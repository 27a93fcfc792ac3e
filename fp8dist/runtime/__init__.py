"""Runtime services every layer above reads, importing nothing of fp8dist but :mod:`fp8dist.config`: the launch
environment and rendezvous (:mod:`.env`, :mod:`.env_vars`, :mod:`.rendezvous`), agreement across ranks
(:mod:`.agree`), output files (:mod:`.files`), installed package versions (:mod:`.packages`), the optimizer and its
step hooks (:mod:`.optim`), the hardware a run is on and the GPU table (:mod:`.hardware`, :mod:`.gpus`), adapter
(LoRA) layers (:mod:`.adapters`) and weights stored transposed (:mod:`.weight_layout`)."""
