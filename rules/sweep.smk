# Stage sweep (CUDA peaks), measure=gpu: one job per model of the sweep plan (its own processes, one GPU),
# then aggregate. The sweep keeps one resumable part file per (model, precision, attention) in
# results/peak_memory_parts/. measure=reuse: no rule here; the committed peak table is an input.

if MEASURE == "gpu":

    localrules:
        aggregate,

    rule sweep:
        input:
            plan=config["sweep_plan"],
            configs=CONFIGS,
        output:
            # The sweep's merged table after this model's job (every part in the folder).
            table="results/peak_memory_parts/{model}.parquet",
        params:
            model_id=model_id,
            parts=lambda wildcards, output: os.path.dirname(output.table),
            extra=config["measure_args"],
        log:
            "logs/sweep/{model}.log",
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            "logs/benchmarks/sweep/{model}.tsv"
        resources:
            gpu=1,
            mem_mb=64000,
            runtime=120,
        shell:
            "python -m pipeline sweep --plan {input.plan:q} --configs {input.configs:q}"
            " --parts {params.parts} --models {params.model_id:q} --out {output.table:q}"
            " {params.extra} > {log:q} 2>&1"

    rule aggregate:
        input:
            tables=measured_models,
        output:
            peaks=PEAKS,
        params:
            parts="results/peak_memory_parts",
        log:
            "logs/aggregate.log",
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            "logs/benchmarks/aggregate.tsv"
        shell:
            "python -m pipeline sweep --aggregate --parts {params.parts} --out {output.peaks:q}"
            " > {log:q} 2>&1"


# Several GPUs: `snakemake --config measure=gpu distributed=true` on a machine (or a SLURM job) with several
# GPUs runs each plan of DISTRIBUTED_PLANS, one torchrun process per point (resumable: a rerun skips the points
# in the table's JSONL); the clients' plans need 2 or 4 GPUs, the loop's 8.
if DISTRIBUTED:

    rule sweep_distributed:
        input:
            plan=lambda wildcards: DISTRIBUTED_PLANS[f"results/{wildcards.sweep}/{wildcards.gpu}/peak_memory.parquet"],
            configs=CONFIGS,
        output:
            peaks="results/{sweep}/{gpu}/peak_memory.parquet",
        wildcard_constraints:
            sweep="distributed|distributed_heldout|distributed_8|distributed_mp_bf16|deepspeed|deepspeed_heldout",
        log:
            "logs/sweep_{sweep}_{gpu}.log",
        resources:
            gpu=8,
        shell:
            "python -m pipeline measure-distributed --plan {input.plan:q} --out {output.peaks:q} > {log:q} 2>&1"
