rule train:
    input:
        latents=planned(paths.LATENT_SHARD, "latents"),
        text=planned(paths.TEXT_SHARD, "text"),
        empty=out(paths.TEXT_EMPTY),
    output:
        adapter=out(paths.ADAPTER_FILE),
        metrics=out(paths.METRICS),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "train"),
    # gpu: processes on this node (diffpipe train launches them). mpi: a launcher
    # put before the command; a profile sets it to srun for multi-node runs,
    # and every srun task then becomes one rank (see profiles/slurm).
    resources:
        gpu=1,
        mpi="",
    log:
        out("logs/train.log"),
    benchmark:
        out("benchmarks/train.tsv")
    shell:
        "{resources.mpi} diffpipe train --config {params.config} --processes {resources.gpu} > {log} 2>&1"
