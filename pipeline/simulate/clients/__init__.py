"""The Trainer clients run for real on the simulated device: transformers.Trainer (`trainer`, and the Trainer
built for the meta device in `parts`), TRL's SFTTrainer (`sft`) and DPOTrainer (`dpo`), on one GPU or, with
the several-GPU wing's world around them (`pipeline.simulate.distributed`), on N."""
