"""GPU check: everything rayvit does only on CUDA, and the study's optimization ladder, on one GPU.

    rayvit gpu-check                      # ViT-L/16 ladder, within 8 minutes on one H100/H200
    rayvit gpu-check --quick              # fewer checks, a shorter ladder: within 3 minutes
    rayvit gpu-check --list               # the checks it would run (no GPU needed)
    rayvit gpu-check --model vit_h16      # the study's ViT-H/16
    rayvit gpu-check --compile            # also torch.compile: DDP and FSDP2 runs, the ladder's compile rung

Checks, each PASS or FAIL with its reason, or N/A where this machine cannot tell (a check that cannot
fail here is never reported as passed):
  nccl         a one-rank NCCL process group all-reduces a CUDA tensor
  precision    fp32, and amp / mixed / pure in bf16 and fp16: a small ViT trains (rayvit.worker.train),
               its loss is finite and falls
  strategies   fsdp (PyTorch FSDP2), fairscale_fsdp (fp32, amp, mixed and pure fp16, with FairScale's own
               gradient clipping) and fairscale_oss at world size 1, same criteria
  hsdp         FSDP2 on a 2-D (replicate, shard) mesh over NCCL in mixed bf16: on two GPUs as 1x2 (equal to
               FSDP) and 2x1 (the shards' fp32 all-reduce across replicas on FSDP2's own stream); on one
               GPU as a 1x1 mesh against FSDP
  layernorm    under mixed, for ddp, fsdp and fairscale_fsdp: LayerNorm weights and outputs fp32 while the
               matmuls run in half (forward hooks), and the norms' gradients fp32
  reduce       the dtype gradients are reduced in (parallel.reduce_dtype): DDP's hook seen on the wire,
               FSDP2's reduce buffer; FairScale's reduce-scatters on two GPUs over NCCL (at one rank
               FairScale sends nothing and forces fp32: N/A on a one-GPU machine)
  decay        fairscale_fsdp weight decay over sharded flat parameters, two gloo ranks sharing the GPU:
               matrices decay, the rest does not
  flash        torch.backends.cuda.flash_sdp_enabled(); SDPA in bf16 runs with only the flash backend
               allowed, for raw tensors and for the ViT's attention in both layouts; and whether SDPA's
               own choice was a flash kernel (profiler)
  recompute    activation checkpointing under bf16 (fairscale_fsdp amp and mixed, fsdp amp): each block's
               matmuls in bf16 in the forward and again in the recompute (FairScale's wrapper enters fp16
               autocast around it), gradients finite; fairscale_fsdp mixed-bf16 checkpointed trains
  memory       per precision level: torch.cuda.max_memory_allocated's growth per image of batch against
               rayvit.projection's activation model (within -25%/+33%), and the peak against its total
  compile      (--compile) model.compile under DDP (amp-bf16, the wrapped model compiled) and FSDP2 (mixed-bf16,
               each block compiled before sharding): same criteria, and compile time recorded
  nvml         a training run's NVML sampler reports utilisation and power over its timed window, and
               peak allocated <= reserved memory, per rank and as the run's figures
  profile      the hardware profile the in-sweep projection picks for this GPU (its name and memory
               size): a GPU profile, never the CPU one, holding the device's memory
  decode       data.decode=gpu: nvJPEG (torchvision.io.decode_jpeg, batched) crops of the sample
               photographs match the CPU decoder's (N/A without torchvision), with both paths' rates
  state        fairscale_fsdp and fsdp: model state per rank the same with and without
               reshard_after_forward, with and without a validation split (an evaluation's forward)
  final model  fairscale_fsdp and fsdp: after training and the final evaluation, the model a run's final
               checkpoint holds (its shards consolidated, or gathered onto rank 0) equals the strategy's
               own full state
  rounds       ddp, fairscale_fsdp and fsdp in one group's rounds: free device memory after each run the
               same in round 2 as in round 1 (FairScale's process groups made before round 1); a NaN loss
               on one of two ranks (NCCL, two GPUs) ends that run on both, and the rounds go on; NCCL's
               count of issued collectives (what ranks compare after each run) grows as they are issued;
               a run after which one of two ranks (two GPUs) issued one collective more ends the group
  (--compile)  two compiled runs in one process: both compile the same graphs from empty caches
Then the ladder (rayvit.studies.plan.plan_ladder) at world size 1: baseline (DDP, amp or fp32, token
classifier, batch-first, loop AdamW, 224 px) -> +mixed precision -> +FSDP -> +MTA optimizer ->
+pooled classifier -> +batch-second -> +256 px -> +full half precision, with per-chip TFLOPS, MFU
and each rung's ratio to the baseline. At one GPU FSDP has nothing to shard across: its rung shows
the wrapper's own cost, not the multi-GPU gain.

Everything goes to a JSON file (--out). Exit status: 0 all passed, 1 a check or rung failed, 2 no CUDA
or bad arguments. Not run by CI or the tests (they need no GPU); run it by hand on a GPU machine.
"""

from rayvit.gpu_check.cases import (NotCheckable, check_activation_memory, check_fairscale_weight_decay,  # noqa: F401
                                    check_flash, check_layer_norm_fp32, check_nccl, check_nvml_sampler,
                                    check_profile, check_reduce_dtype, check_training)
from rayvit.gpu_check.check_gpu import check_gpu, list_plan, no_cuda_reason  # noqa: F401
from rayvit.gpu_check.checklist import plan_checks, run_check, run_checks  # noqa: F401
from rayvit.gpu_check.checkpoints import check_final_model  # noqa: F401
from rayvit.gpu_check.decode import check_gpu_decode  # noqa: F401
from rayvit.gpu_check.group_cases import (check_cold_compile, check_collective_counts, check_group_memory,  # noqa: F401
                                          check_nan_on_one_rank, check_out_of_step, check_state_after_evaluation)
from rayvit.gpu_check.hsdp_cases import check_hsdp  # noqa: F401
from rayvit.gpu_check.ladder_runs import GpuCheckOptions, ladder_config, run_ladder  # noqa: F401
from rayvit.gpu_check.recompute import check_recompute_dtype  # noqa: F401
