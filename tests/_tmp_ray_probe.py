import os, sys, time, resource
import ray
t = time.time()
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "GLOO_SOCKET_IFNAME": "lo"}})
print("init", time.time() - t, flush=True)
mode = sys.argv[1]
def noop(config):
    import torch
def fit():
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    t = time.time()
    TorchTrainer(noop, scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 run_config=RunConfig(storage_path="/tmp/ci/raystore", name=f"r{time.time()}")).fit()
    print("fit", time.time() - t, flush=True)
if mode == "idle":
    time.sleep(30)
else:
    for _ in range(int(mode)):
        fit()
t = time.time()
ray.shutdown()
print("shutdown", time.time() - t)
