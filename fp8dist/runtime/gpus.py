"""The one table of GPU figures: each GPU's dense peaks (NVIDIA's datasheets print sparse ones, twice as high),
bandwidth and memory with its datasheet, and the speed model's fitted constants (H100's and B200's; every other GPU
borrows one and its predictions are labelled uncalibrated). ``--target``, the speed model and MFU read it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

__all__ = ["Source", "Calibration", "GpuSpec", "GPUS", "H100_CALIBRATION", "B200_CALIBRATION", "gpu_by_key",
           "gpu_by_device_name"]


@dataclass(frozen=True)
class Source:
    """Where a figure comes from: the document's title and address."""

    document: str
    """The document's title."""
    url: str
    """Where to read it."""
    note: str = ""
    """How the figure was read from it (e.g. the sparse figure halved)."""


@dataclass(frozen=True)
class Calibration:
    """The speed model's constants no datasheet gives: the fractions of the peaks real kernels reach, how much
    slower than its ideal traffic a cast runs, and the shortest a kernel takes."""

    bf16_gemm_fraction: float
    """Fraction of the dense bf16 / FP8 peak a large GEMM reaches (FP8 fitted: speedups fix only their ratio)."""
    fp8_gemm_fraction: float
    memory_fraction: float
    """Fraction of the memory bandwidth a large elementwise kernel reaches."""
    cast_slowdown: tuple[float, float, float]
    """(input, weight, grad_output): an operand's column-wise scaling pass over its ideal traffic (fitted; it absorbs
    whatever else scales with that operand in the measured FP8 run)."""
    kernel_floor_s: float
    """The shortest time any kernel takes (launch and ramp-up), in seconds."""
    measured_on: str
    """The GPU key whose published measurements these constants were fitted on."""
    source: Source
    recipes: tuple[str, ...] = ("rowwise",)
    """The speed recipes whose own measurements on ``measured_on`` were fitted: their predictions are calibrated."""
    mx_gemm_fraction: float | None = None
    """Fraction of the dense FP8 / FP4 peak an MXFP8 / NVFP4 GEMM reaches; None: ``fp8_gemm_fraction``."""
    fp4_gemm_fraction: float | None = None
    block_cast_slowdown: tuple[float, float] = (1.0, 1.0)
    """(torchao, Transformer Engine): a block-scaling (MXFP8, NVFP4) quantize kernel of that backend over its ideal
    traffic, fitted on published training steps and TE's training GEMM speedups (benchmarks/step_model/fit.py);
    1: not measured."""
    grouped_gemm_efficiency: float = 1.0
    """The fraction of a dense GEMM's rate a grouped GEMM of MoE experts (``torch._grouped_mm``) reaches (fitted on
    the B200's MXFP8 grouped table; 1: not measured)."""
    grouped_block_cast_slowdown: float | None = None
    """The MXFP8 grouped GEMM's quantize and scale-layout kernels over their ideal traffic; None: the MXFP8
    ``block_cast_slowdown``."""

    def gemm_fraction(self, gemm: str, grouped: bool = False) -> float:
        """The fraction of its peak a GEMM of kind ``gemm`` ("bf16", "fp8", "mx", "fp4"; ``grouped``: MoE) reaches."""
        chosen = {"bf16": self.bf16_gemm_fraction, "mx": self.mx_gemm_fraction,
                  "fp4": self.fp4_gemm_fraction}.get(gemm)
        fraction = self.fp8_gemm_fraction if chosen is None else chosen
        return fraction * self.grouped_gemm_efficiency if grouped else fraction


H100_CALIBRATION = Calibration(
    bf16_gemm_fraction=0.78,
    fp8_gemm_fraction=0.978,
    memory_fraction=0.92,
    cast_slowdown=(9.15, 5.85, 4.39),
    kernel_floor_s=2e-6,
    measured_on="h100-hbm2e",
    source=Source(
        "torchao float8 rowwise vs bfloat16 speedup table, H100 (LayerNorm -> Linear -> Sigmoid, fwd + bwd, "
        "compiled), 216 shapes",
        "https://github.com/pytorch/ao/blob/fdddb2cfa2a4ea930dfce9ef23429013b466b22d/docs/static/fp8-rowwise-perf.png",
        "fp8_gemm_fraction and cast_slowdown fitted by benchmarks/speed_model/fit.py on the rows M in {1024, "
        "4096, 16384} of tests/data/torchao_fp8_rowwise_h100.csv against the record of the part that measured "
        "them, h100-hbm2e (Meta's 2.4 TB/s H100: roofline_utils.py's H100 figures are that part's); a cast's "
        "seconds scale with the target's own bandwidth; bf16_gemm_fraction, "
        "memory_fraction and kernel_floor_s are torchao's H100 figures (torchao/testing/training/"
        "roofline_utils.py: pct_achievable_gemm_tops, pct_achievable_mem_bw, KERNEL_LAUNCH_OVERHEAD_SEC)"),
)
"""Fitted by ``benchmarks/speed_model/fit.py`` (its JSON beside it holds the same numbers)."""

B200_CALIBRATION = dataclasses.replace(
    H100_CALIBRATION,
    measured_on="b200",
    recipes=("moe_mxfp8",),
    mx_gemm_fraction=0.765,
    fp4_gemm_fraction=0.865,
    block_cast_slowdown=(1.46, 2.08),
    grouped_gemm_efficiency=0.463,
    grouped_block_cast_slowdown=3.01,
    source=Source(
        "torchao B200 inference roofline table (ReLU -> Linear, forward, compiled; mxfp8_cublas and nvfp4 with "
        "dynamic global scaling vs bfloat16, M = K = N from 1,024 to 16,384)",
        "https://github.com/pytorch/ao/blob/a4ee1fb6ad603cc321281c089a2004ece8e857bc/docs/source/workflows/"
        "inference.md",
        "mx_gemm_fraction and fp4_gemm_fraction fitted by benchmarks/speed_model/fit_b200.py "
        "on the rows M in {1024, 4096, 16384} of benchmarks/speed_model/torchao_b200_forward.csv (2026-11-26); "
        "block_cast_slowdown (torchao's, TE's block-scaling casts) fitted on training steps and TE's training GEMM "
        "speedups by benchmarks/step_model/fit.py (the forward table's quantize kernels are inference ones); "
        "the other constants are the H100's (torchao's roofline_utils.py copies the H100 fractions to the B200 too); "
        "grouped_gemm_efficiency and grouped_block_cast_slowdown fitted by fit_b200.py on the rows G in {1, 8} of "
        "benchmarks/speed_model/torchao_b200_moe_mxfp8.csv, torchao's MXFP8 grouped-GEMM forward + backward table "
        "(https://github.com/pytorch/ao/blob/5e79e5ed3434aa04281931039da1bab338c415b3/torchao/prototype/"
        "moe_training/README.md)"),
)
"""Fitted by ``benchmarks/speed_model/fit_b200.py``; FP8 per-tensor/per-row GEMMs and casts keep the H100's. The
forward table is inference only, so only ``moe_mxfp8`` (fitted on training measurements) is calibrated."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as fp8dist plans for it."""

    key: str
    """The name ``--target`` takes (lower case)."""
    label: str
    """What messages call it ("H100")."""
    capability: tuple[int, int]
    """Its CUDA compute capability (major, minor): (9, 0) for Hopper."""
    device_pattern: str
    """A regular expression :func:`torch.cuda.get_device_name` of this GPU matches (case-insensitive)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float | None
    """Dense FP8 tensor-core peak, TFLOP/s; None without FP8 tensor cores."""
    memory_tbps: float
    """Memory bandwidth, TB/s."""
    memory_gib: float
    """The datasheet's "80 GB" of HBM is binary (five 16 GiB stacks); CUDA reports a little less."""
    source: Source
    """The datasheet the figures above come from."""
    calibration: Calibration = H100_CALIBRATION
    """The speed model's fitted constants: this GPU's own where measured on it (:attr:`calibrated`), else borrowed."""
    fp4_tflops: float | None = None
    """Dense FP4 (NVFP4) peak, TFLOP/s; None where the GPU (or its datasheet) has none."""
    interconnect_gbps: float | None = None
    """GPU-to-GPU bandwidth inside the NVLink domain, GB/s, both directions as datasheets print it; the step model
    uses half per direction. None: not in the datasheet (the step model refuses sharded runs on it)."""
    nvlink_domain: int = 8
    """GPUs that reach each other at ``interconnect_gbps``: an HGX / DGX node's 8 (NVLink, or PCIe where it has
    none), an NVL72 rack's 72; beyond it collectives cross the network."""
    network_gbps: float = 50.0
    """Bandwidth between NVLink domains per GPU and direction, in GB/s (gigabytes: a 400 Gb/s NIC is 50 GB/s)."""
    network_source: str = ("one 400 Gb/s NIC per GPU (ConnectX-7 InfiniBand / RoCE, as DGX H100, DGX B200 and "
                           "torchtitan's Grand Teton hosts have): 50 GB/s")
    """Where ``network_gbps`` comes from (or that it is assumed)."""

    @property
    def calibrated(self) -> bool:
        """Whether this GPU's calibration was measured on it (else borrowed from another record's)."""
        return self.calibration.measured_on == self.key

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (a dense FP8 peak in its record)."""
        return self.fp8_tflops is not None

    def describe(self) -> str:
        """The record in a line, with its datasheet and the constants' origin (what ``fp8dist env`` prints)."""
        fp8 = f"FP8 {self.fp8_tflops:g} TFLOP/s" if self.has_fp8 else "no FP8 tensor cores"
        fp8 += f", FP4 {self.fp4_tflops:g} TFLOP/s" if self.fp4_tflops else ""
        measured = ", ".join(self.calibration.recipes) or "no training recipe"
        fitted = (f"fitted on its own published measurements ({measured})" if self.calibrated else
                  f"borrowed from {self.calibration.measured_on} (its predictions uncalibrated)")
        return (f"{self.label} ({self.key}): dense bf16 {self.bf16_tflops:g} TFLOP/s, {fp8}, {self.memory_tbps:g} "
                f"TB/s ({self.source.document}, {self.source.url}: {self.source.note}); speed model constants "
                f"{fitted}; NVLink domain {self.nvlink_domain} GPUs, network {self.network_gbps:g} GB/s per GPU "
                f"between domains ({self.network_source})")


_HOPPER = Source("NVIDIA H100 Tensor Core GPU datasheet", "https://www.nvidia.com/en-us/data-center/h100/",
                 "H100 SXM column; BF16 1,979 and FP8 3,958 TFLOPS are with sparsity, halved; NVLink 900 GB/s")

# Blackwell Ultra: NVIDIA's own figures are in its Blackwell architecture brief (v2.1 adds HGX B300 and GB300),
# which could not be fetched from here; its tables were read through a transcription and checked against a second
# independent reading (Verda's GB300 NVL72 page), both giving the same per-GPU figures.
_BLACKWELL_BRIEF_HGX = Source(
    "NVIDIA Blackwell Architecture Technical Brief v2.1", "https://resources.nvidia.com/en-us-blackwell-architecture",
    "Table 3, HGX B300 per GPU, dense / sparse: FP4 14 / 18, FP8/FP6 4.5 / 9, FP16/BF16 2.2 / 4.5 PFLOPS (the sparse "
    "figure halved: 2.25); 270 GB HBM3e at 7.7 TB/s (the same table gives the HGX B200 7.7 TB/s where the b200 "
    "record's HGX page gives 8.0); NVLink 5 1.8 TB/s per GPU; capability (10, 3) is Blackwell Ultra's sm_103; read "
    "through a transcription of the PDF, cross-checked against https://verda.com/blog/gb300-nvl72-architecture")

GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("a100", "A100", (8, 0), r"\bA100\b", 312.0, None, 2.039, 80.0, Source(
        "NVIDIA A100 Tensor Core GPU datasheet", "https://www.nvidia.com/en-us/data-center/a100/",
        "A100 80GB SXM column; BF16 312 TFLOPS dense; no FP8; NVLink 600 GB/s"), interconnect_gbps=600.0),
    GpuSpec("l4", "L4", (8, 9), r"\bL4\b", 121.0, 242.5, 0.300, 24.0, Source(
        "NVIDIA L4 Tensor Core GPU datasheet", "https://www.nvidia.com/en-us/data-center/l4/",
        "BF16 242 and FP8 485 TFLOPS are with sparsity, halved; no NVLink: PCIe Gen4 x16 64 GB/s"),
            interconnect_gbps=64.0),
    GpuSpec("l40s", "L40S", (8, 9), r"\bL40S\b", 362.05, 733.0, 0.864, 48.0, Source(
        "NVIDIA L40S GPU datasheet", "https://www.nvidia.com/en-us/data-center/l40s/",
        "BF16 733 and FP8 1,466 TFLOPS are with sparsity, halved; no NVLink: PCIe Gen4 x16 64 GB/s"),
            interconnect_gbps=64.0),
    GpuSpec("rtx4090", "RTX 4090", (8, 9), r"RTX 4090", 165.2, 330.3, 1.008, 24.0, Source(
        "NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090)",
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        "dense peaks with FP32 accumulate (training accumulates in FP32; GeForce runs it at half the FP16-"
        "accumulate rate); no NVLink: PCIe Gen4 x16, 64 GB/s"), interconnect_gbps=64.0),
    GpuSpec("h100", "H100", (9, 0), r"H100(?!.*(PCIe|NVL))", 989.4, 1978.9, 3.35, 80.0, _HOPPER,
            interconnect_gbps=900.0),
    GpuSpec("h100-pcie", "H100 PCIe", (9, 0), r"H100.*PCIe", 756.5, 1513.0, 2.0, 80.0, Source(
        _HOPPER.document, _HOPPER.url, "H100 PCIe column; BF16 1,513 and FP8 3,026 TFLOPS are with sparsity, "
        "halved; NVLink 600 GB/s (2- or 4-way bridge)"), interconnect_gbps=600.0),
    GpuSpec("h100-hbm2e", "H100 96GB HBM2e", (9, 0), r"(?!)", 989.4, 1978.9, 2.4, 96.0, Source(
        "torchtitan benchmarks: Llama 3.1 on Grand Teton (H100 96GB HBM2e, 2.4 TB/s, 500 W power limit)",
        "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/"
        "llama3_h100_202412_torchtitan.md",
        "Meta's H100 variant that torchao's and torchtitan's H100 tables were measured on (torchao's "
        "roofline_utils.py: '2.4 TB per second, custom to Meta's H100 variant'); its 500 W limit (the SXM's TDP is "
        "700 W) lowers the clocks under load, which no peak here shows; peaks and NVLink 900 GB/s are the H100 SXM "
        "datasheet's; named by --target only (CUDA calls it an H100 too)"), interconnect_gbps=900.0),
    GpuSpec("h200", "H200", (9, 0), r"(?<!G)H200", 989.4, 1978.9, 4.8, 141.0, Source(
        "NVIDIA H200 Tensor Core GPU datasheet", "https://www.nvidia.com/en-us/data-center/h200/",
        "H200 SXM column; BF16 1,979 and FP8 3,958 TFLOPS are with sparsity, halved; NVLink 900 GB/s"),
            interconnect_gbps=900.0),
    GpuSpec("gh200", "GH200", (9, 0), r"GH200", 989.4, 1978.9, 4.0, 96.0, Source(
        "NVIDIA GH200 Grace Hopper Superchip datasheet",
        "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/",
        "the Hopper GPU's BF16 1,979 and FP8 3,958 TFLOPS are with sparsity, halved; 4 TB/s is the 96 GB HBM3 "
        "version (the 144 GB HBM3e one has 4.9 TB/s); NVLink 900 GB/s"), interconnect_gbps=900.0),
    GpuSpec("b200", "B200", (10, 0), r"(?<!G)B200", 2250.0, 4500.0, 8.0, 180.0, Source(
        "NVIDIA HGX platform (HGX B200) specifications", "https://www.nvidia.com/en-us/data-center/hgx/",
        "8-GPU board: FP4 144, FP8 72 and BF16 36 PFLOPS with sparsity, divided by 8 and halved; 64 TB/s and "
        "1,440 GB divided by 8 (torchao's roofline_utils.py gives the same dense 9.0 / 4.5 / 2.25 PFLOPS from the "
        "Blackwell architecture brief, p. 19); NVLink 1.8 TB/s per GPU"), calibration=B200_CALIBRATION,
            fp4_tflops=9000.0, interconnect_gbps=1800.0),
    GpuSpec("gb200", "GB200", (10, 0), r"GB200", 2500.0, 5000.0, 8.0, 186.0, Source(
        "NVIDIA GB200 NVL72 specifications", "https://www.nvidia.com/en-us/data-center/gb200-nvl72/",
        "per GB200 superchip (two GPUs): FP4 40, FP8 20 and BF16 10 PFLOPS with sparsity, 16 TB/s; halved "
        "twice; 372 GB HBM3e, halved; NVLink 1.8 TB/s per GPU"), calibration=B200_CALIBRATION,
            fp4_tflops=10000.0, interconnect_gbps=1800.0, nvlink_domain=72,
            network_source="ConnectX-7 400 Gb/s NICs on each 4-GPU compute tray (NVIDIA multi-node NVLink tuning "
            "guide, https://docs.nvidia.com/multi-node-nvlink-systems/multi-node-tuning-guide/system.html), one per "
            "GPU as on the GB300 tray: 50 GB/s between racks; the 72 GPUs share one NVLink 5 domain (130 TB/s)"),
    GpuSpec("b300", "B300", (10, 3), r"(?<!G)B300", 2250.0, 4500.0, 7.7, 270.0, _BLACKWELL_BRIEF_HGX,
            calibration=B200_CALIBRATION, fp4_tflops=14000.0, interconnect_gbps=1800.0, network_gbps=100.0,
            network_source="NVIDIA HGX specifications (https://www.nvidia.com/en-us/data-center/hgx/): networking "
            "1.6 TB/s for HGX B300 (0.8 TB/s for HGX B200), both directions over 8 GPUs: one 800 Gb/s ConnectX-8 "
            "SuperNIC per GPU, 100 GB/s"),
    GpuSpec("gb300", "GB300", (10, 3), r"GB300", 2500.0, 5000.0, 8.0, 279.0, Source(
        _BLACKWELL_BRIEF_HGX.document, _BLACKWELL_BRIEF_HGX.url,
        "Table 2, GB300 NVL72 (72 GPUs): FP4 1,080, FP8/FP6 360 and FP16/BF16 180 PFLOPS dense, 576 TB/s, divided by "
        "72; 279 GB HBM3e per GPU (p. 17); NVLink 1.8 TB/s per GPU; read as _BLACKWELL_BRIEF_HGX says"),
            calibration=B200_CALIBRATION, fp4_tflops=15000.0, interconnect_gbps=1800.0, nvlink_domain=72,
            network_gbps=100.0,
            network_source="NVIDIA GB300 NVL72 Enterprise RA (https://docs.nvidia.com/enterprise-reference-"
            "architectures/nvl72-ai-factory/latest/components.html): 4 ConnectX-8 HCAs per 4-GPU compute tray, one "
            "800 Gb/s per GPU between racks: 100 GB/s; the 72 GPUs share one NVLink 5 domain (130 TB/s)"),
    GpuSpec("mi300x", "MI300X", (9, 4), r"MI300X", 1307.4, 2614.9, 5.3, 192.0, Source(
        "AMD Instinct MI300X accelerator data sheet",
        "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
        "amd-instinct-mi300x-data-sheet.pdf",
        "dense BF16 1,307.4 and FP8 2,614.9 TFLOPS (the sheet prints sparse figures apart), 5.3 TB/s, 192 GB HBM3; "
        "Infinity Fabric 7 links x 128 GB/s = 896 GB/s to the other 7 GPUs; capability (9, 4) is what ROCm's torch "
        "reports for gfx942"), interconnect_gbps=896.0),
)
"""Every GPU the speed model and the memory fit know, each with its datasheet figures and their source: the
``--target`` choices (by ``key``), and what a CUDA device's name is matched against (``device_pattern``). Look one up
with :func:`gpu_by_key` or :func:`gpu_by_device_name`."""


def gpu_by_key(key: str) -> GpuSpec | None:
    """The GPU record whose ``key`` is ``key`` (a ``--target`` name, case-insensitive, spaces around ignored), or
    None for a name not in :data:`GPUS`."""
    return next((spec for spec in GPUS if spec.key == key.strip().lower()), None)


def gpu_by_device_name(name: str) -> GpuSpec | None:
    """The GPU :func:`torch.cuda.get_device_name` calls ``name`` ("NVIDIA H100 80GB HBM3"), or None."""
    return next((spec for spec in GPUS if re.search(spec.device_pattern, name, re.IGNORECASE)), None)
