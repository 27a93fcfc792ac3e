"""The precision plan and the evidence it decides by: the speed model (:mod:`.speed`), the numerics probe
(:mod:`.numerics`), the GPU table and the hardware a plan is made for."""
