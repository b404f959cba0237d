"""Does transformers' Trainer run FSDP2 with CPU offload (`fsdp="full_shard offload auto_wrap"`, version 2) on
today's stack, and what does a step hold on the GPU and the host? A probe for issue 36, launched as

    torchrun --nproc_per_node 2 benchmarks/probe_fsdp_offload.py MODEL_ID BATCH SEQ [--no-clip] [--fsdp1]

It prints one JSON line per rank: the step's peak allocated and reserved bytes, the host's peak resident bytes,
or the exception the step raised."""

import json
import os
import resource
import sys
import traceback


def main():
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from pipeline.inputs.configs import read_config_records
    from pipeline.inputs.modeling import training_config
    from pipeline.simulate.predict import as_config

    model_id, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    clip = "--no-clip" not in sys.argv
    version = 1 if "--fsdp1" in sys.argv else 2
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    config = training_config(as_config(read_config_records("results/configs.json")[model_id]["config"]))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch * 2, seq))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir="/tmp/probe", per_device_train_batch_size=batch, max_steps=2, bf16=True,
                             gradient_checkpointing=True, fsdp="full_shard offload auto_wrap",
                             fsdp_config={"version": version,
                                          "transformer_layer_cls_to_wrap": [model.model.layers[0].__class__.__name__]},
                             max_grad_norm=1.0 if clip else 0.0, report_to="none", save_strategy="no",
                             logging_strategy="no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    out = {"rank": rank, "model": model_id, "batch": batch, "seq": seq, "clip": clip, "fsdp_version": version}
    try:
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        out.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                   host_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    except Exception as exc:  # the answer to the probe
        frames = [f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
                  for frame in traceback.extract_tb(exc.__traceback__)]
        out.update(error=f"{type(exc).__name__}: {exc}"[:300], frames=frames[:14])
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
