"""Host memory of every SageMaker HyperPod cluster instance type.

The figures are the instance memory in GiB that AWS publishes in its EC2 instance type
specifications (docs.aws.amazon.com/ec2/latest/instancetypes). A SageMaker ``ml.`` type runs on
the same hardware as the EC2 type with the same name minus the ``ml.`` prefix, so
``ml.p5.48xlarge`` has the 2,048 GiB of ``p5.48xlarge``.

These are the real sizes. The control plane does not give a simulated node this much memory: it
scales the figures down by its simulation factor where it sizes nodes. Keep this table to what
AWS documents.

The keys are exactly the values of botocore's SageMaker ``ClusterInstanceType`` enum;
``tests/test_instance_types.py`` fails when botocore adds a type that is missing here.
"""

from __future__ import annotations

from typing import Final

GIB: Final = 2**30

INSTANCE_MEMORY_GIB: Final[dict[str, float]] = {
    # --- P: NVIDIA training GPUs --------------------------------------------------------
    "ml.p4d.24xlarge": 1152,
    "ml.p4de.24xlarge": 1152,
    "ml.p5.4xlarge": 256,  # the one-H100 P5 size: 16 vCPUs, 256 GiB
    "ml.p5.48xlarge": 2048,
    "ml.p5e.48xlarge": 2048,
    "ml.p5en.48xlarge": 2048,
    "ml.p6-b200.48xlarge": 2048,
    # 4 TiB: twice the P6-B200. Given both by AWS's own HyperPod CLI resource table and by the
    # EC2 data behind instances.vantage.sh; not read on the EC2 spec page itself.
    "ml.p6-b300.48xlarge": 4096,
    # One GB200 compute tray: 4 GPUs and 2 Grace CPUs, 144 vCPUs, 960 GiB of host memory (the
    # Grace LPDDR5X). Some third-party pages give 740 here; that is the GPUs' HBM (4 x 185 GB),
    # not host memory. 960 is what AWS's HyperPod CLI resource table uses.
    "ml.p6e-gb200.36xlarge": 960,
    # --- Trainium ------------------------------------------------------------------------
    "ml.trn1.32xlarge": 512,
    "ml.trn1n.32xlarge": 512,
    "ml.trn2.3xlarge": 128,  # one Trainium2 chip, 12 vCPUs (per AWS's HyperPod CLI table)
    "ml.trn2.48xlarge": 2048,
    # --- G4dn: NVIDIA T4 -----------------------------------------------------------------
    "ml.g4dn.xlarge": 16,
    "ml.g4dn.2xlarge": 32,
    "ml.g4dn.4xlarge": 64,
    "ml.g4dn.8xlarge": 128,
    "ml.g4dn.12xlarge": 192,
    "ml.g4dn.16xlarge": 256,
    # --- G5: NVIDIA A10G -----------------------------------------------------------------
    "ml.g5.xlarge": 16,
    "ml.g5.2xlarge": 32,
    "ml.g5.4xlarge": 64,
    "ml.g5.8xlarge": 128,
    "ml.g5.12xlarge": 192,
    "ml.g5.16xlarge": 256,
    "ml.g5.24xlarge": 384,
    "ml.g5.48xlarge": 768,
    # --- G6: NVIDIA L4 -------------------------------------------------------------------
    "ml.g6.xlarge": 16,
    "ml.g6.2xlarge": 32,
    "ml.g6.4xlarge": 64,
    "ml.g6.8xlarge": 128,
    "ml.g6.12xlarge": 192,
    "ml.g6.16xlarge": 256,
    "ml.g6.24xlarge": 384,
    "ml.g6.48xlarge": 768,
    # --- Gr6: NVIDIA L4, memory-heavy (8 GiB per vCPU) -----------------------------------
    "ml.gr6.4xlarge": 128,
    "ml.gr6.8xlarge": 256,
    # --- G6e: NVIDIA L40S ----------------------------------------------------------------
    "ml.g6e.xlarge": 32,
    "ml.g6e.2xlarge": 64,
    "ml.g6e.4xlarge": 128,
    "ml.g6e.8xlarge": 256,
    "ml.g6e.12xlarge": 384,
    "ml.g6e.16xlarge": 512,
    "ml.g6e.24xlarge": 768,
    "ml.g6e.48xlarge": 1536,
    # --- G7: NVIDIA RTX PRO 4500 Blackwell Server Edition, 4 GiB per vCPU ----------------
    # 2xlarge to 12xlarge seen in several places (AWS pricing data, WorkSpaces G7 bundles on
    # the same hardware). 24xlarge and 48xlarge come from one secondary listing only; they
    # follow the family's 4 GiB per vCPU (96 and 192 vCPUs).
    "ml.g7.2xlarge": 32,
    "ml.g7.4xlarge": 64,
    "ml.g7.8xlarge": 128,
    "ml.g7.12xlarge": 192,
    "ml.g7.24xlarge": 384,
    "ml.g7.48xlarge": 768,
    # --- G7e: NVIDIA RTX PRO 6000 Blackwell Server Edition -------------------------------
    # 8 GiB per vCPU up to 8xlarge, then about 10.7 GiB per vCPU on the multi-GPU sizes.
    "ml.g7e.2xlarge": 64,
    "ml.g7e.4xlarge": 128,
    "ml.g7e.8xlarge": 256,
    "ml.g7e.12xlarge": 512,
    "ml.g7e.24xlarge": 1024,
    "ml.g7e.48xlarge": 2048,
    # --- C5: compute optimized, Intel ----------------------------------------------------
    "ml.c5.large": 4,
    "ml.c5.xlarge": 8,
    "ml.c5.2xlarge": 16,
    "ml.c5.4xlarge": 32,
    "ml.c5.9xlarge": 72,
    "ml.c5.12xlarge": 96,
    "ml.c5.18xlarge": 144,
    "ml.c5.24xlarge": 192,
    # --- C5n: network optimized; irregular sizes, as EC2 documents them -------------------
    "ml.c5n.large": 5.25,
    "ml.c5n.2xlarge": 21,
    "ml.c5n.4xlarge": 42,
    "ml.c5n.9xlarge": 96,
    "ml.c5n.18xlarge": 192,
    # --- C6i: compute optimized, Intel, 2 GiB per vCPU -----------------------------------
    "ml.c6i.large": 4,
    "ml.c6i.xlarge": 8,
    "ml.c6i.2xlarge": 16,
    "ml.c6i.4xlarge": 32,
    "ml.c6i.8xlarge": 64,
    "ml.c6i.12xlarge": 96,
    "ml.c6i.16xlarge": 128,
    "ml.c6i.24xlarge": 192,
    "ml.c6i.32xlarge": 256,
    # --- C6a: compute optimized, AMD, 2 GiB per vCPU -------------------------------------
    "ml.c6a.large": 4,
    "ml.c6a.xlarge": 8,
    "ml.c6a.2xlarge": 16,
    "ml.c6a.4xlarge": 32,
    "ml.c6a.8xlarge": 64,
    "ml.c6a.12xlarge": 96,
    "ml.c6a.16xlarge": 128,
    "ml.c6a.24xlarge": 192,
    "ml.c6a.32xlarge": 256,
    "ml.c6a.48xlarge": 384,
    # --- C6g / C7g / C8g: compute optimized, Graviton, 2 GiB per vCPU ---------------------
    "ml.c6g.medium": 2,
    "ml.c6g.large": 4,
    "ml.c6g.xlarge": 8,
    "ml.c6g.2xlarge": 16,
    "ml.c6g.4xlarge": 32,
    "ml.c6g.8xlarge": 64,
    "ml.c6g.12xlarge": 96,
    "ml.c6g.16xlarge": 128,
    "ml.c7g.medium": 2,
    "ml.c7g.large": 4,
    "ml.c7g.xlarge": 8,
    "ml.c7g.2xlarge": 16,
    "ml.c7g.4xlarge": 32,
    "ml.c7g.8xlarge": 64,
    "ml.c7g.12xlarge": 96,
    "ml.c7g.16xlarge": 128,
    "ml.c8g.medium": 2,
    "ml.c8g.large": 4,
    "ml.c8g.xlarge": 8,
    "ml.c8g.2xlarge": 16,
    "ml.c8g.4xlarge": 32,
    "ml.c8g.8xlarge": 64,
    "ml.c8g.12xlarge": 96,
    "ml.c8g.16xlarge": 128,
    "ml.c8g.24xlarge": 192,
    "ml.c8g.48xlarge": 384,
    # --- C8a: compute optimized, 5th gen AMD EPYC, no SMT: 64 vCPUs, 2 GiB per vCPU --------
    "ml.c8a.16xlarge": 128,
    # --- M5: general purpose, Intel, 4 GiB per vCPU --------------------------------------
    "ml.m5.large": 8,
    "ml.m5.xlarge": 16,
    "ml.m5.2xlarge": 32,
    "ml.m5.4xlarge": 64,
    "ml.m5.8xlarge": 128,
    "ml.m5.12xlarge": 192,
    "ml.m5.16xlarge": 256,
    "ml.m5.24xlarge": 384,
    # --- M6i: general purpose, Intel, 4 GiB per vCPU -------------------------------------
    "ml.m6i.large": 8,
    "ml.m6i.xlarge": 16,
    "ml.m6i.2xlarge": 32,
    "ml.m6i.4xlarge": 64,
    "ml.m6i.8xlarge": 128,
    "ml.m6i.12xlarge": 192,
    "ml.m6i.16xlarge": 256,
    "ml.m6i.24xlarge": 384,
    "ml.m6i.32xlarge": 512,
    # --- M6a: general purpose, AMD, 4 GiB per vCPU ---------------------------------------
    "ml.m6a.large": 8,
    "ml.m6a.xlarge": 16,
    "ml.m6a.2xlarge": 32,
    "ml.m6a.4xlarge": 64,
    "ml.m6a.8xlarge": 128,
    "ml.m6a.12xlarge": 192,
    "ml.m6a.16xlarge": 256,
    "ml.m6a.24xlarge": 384,
    "ml.m6a.32xlarge": 512,
    "ml.m6a.48xlarge": 768,
    # --- M7i: general purpose, Intel, 4 GiB per vCPU -------------------------------------
    "ml.m7i.large": 8,
    "ml.m7i.xlarge": 16,
    "ml.m7i.2xlarge": 32,
    "ml.m7i.4xlarge": 64,
    "ml.m7i.8xlarge": 128,
    "ml.m7i.12xlarge": 192,
    "ml.m7i.16xlarge": 256,
    "ml.m7i.24xlarge": 384,
    "ml.m7i.48xlarge": 768,
    # --- M6g / M7g / M8g: general purpose, Graviton, 4 GiB per vCPU -----------------------
    "ml.m6g.medium": 4,
    "ml.m6g.large": 8,
    "ml.m6g.xlarge": 16,
    "ml.m6g.2xlarge": 32,
    "ml.m6g.4xlarge": 64,
    "ml.m6g.8xlarge": 128,
    "ml.m6g.12xlarge": 192,
    "ml.m6g.16xlarge": 256,
    "ml.m7g.medium": 4,
    "ml.m7g.large": 8,
    "ml.m7g.xlarge": 16,
    "ml.m7g.2xlarge": 32,
    "ml.m7g.4xlarge": 64,
    "ml.m7g.8xlarge": 128,
    "ml.m7g.12xlarge": 192,
    "ml.m7g.16xlarge": 256,
    "ml.m8g.medium": 4,
    "ml.m8g.large": 8,
    "ml.m8g.xlarge": 16,
    "ml.m8g.2xlarge": 32,
    "ml.m8g.4xlarge": 64,
    "ml.m8g.8xlarge": 128,
    "ml.m8g.12xlarge": 192,
    "ml.m8g.16xlarge": 256,
    "ml.m8g.24xlarge": 384,
    "ml.m8g.48xlarge": 768,
    # --- M8a: general purpose, 5th gen AMD EPYC, no SMT: 64 vCPUs, 4 GiB per vCPU ----------
    "ml.m8a.16xlarge": 256,
    # --- T3: burstable -------------------------------------------------------------------
    "ml.t3.medium": 4,
    "ml.t3.large": 8,
    "ml.t3.xlarge": 16,
    "ml.t3.2xlarge": 32,
    # --- R: memory optimized, 8 GiB per vCPU ---------------------------------------------
    "ml.r5d.16xlarge": 512,
    "ml.r6i.large": 16,
    "ml.r6i.xlarge": 32,
    "ml.r6i.2xlarge": 64,
    "ml.r6i.4xlarge": 128,
    "ml.r6i.8xlarge": 256,
    "ml.r6i.12xlarge": 384,
    "ml.r6i.16xlarge": 512,
    "ml.r6i.24xlarge": 768,
    "ml.r6i.32xlarge": 1024,
    "ml.r7i.large": 16,
    "ml.r7i.xlarge": 32,
    "ml.r7i.2xlarge": 64,
    "ml.r7i.4xlarge": 128,
    "ml.r7i.8xlarge": 256,
    "ml.r7i.12xlarge": 384,
    "ml.r7i.16xlarge": 512,
    "ml.r7i.24xlarge": 768,
    "ml.r7i.48xlarge": 1536,
    # --- I3en: storage optimized, 8 GiB per vCPU -----------------------------------------
    "ml.i3en.large": 16,
    "ml.i3en.xlarge": 32,
    "ml.i3en.2xlarge": 64,
    "ml.i3en.3xlarge": 96,
    "ml.i3en.6xlarge": 192,
    "ml.i3en.12xlarge": 384,
    "ml.i3en.24xlarge": 768,
}


def instance_memory_bytes(instance_type: str) -> int:
    """The real host memory of ``instance_type`` (an ``ml.`` type) in bytes.

    Raises ``KeyError`` for a type that is not in :data:`INSTANCE_MEMORY_GIB`.
    """
    try:
        gib = INSTANCE_MEMORY_GIB[instance_type]
    except KeyError:
        raise KeyError(
            f"unknown instance type {instance_type!r}: no memory size recorded for it in "
            "hyperpod_sim.domain.instance_types.INSTANCE_MEMORY_GIB"
        ) from None
    return int(gib * GIB)
