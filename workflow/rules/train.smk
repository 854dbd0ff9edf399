rule train:
    input:
        latents=planned(paths.LATENT_SHARD, "latents"),
        text=planned(paths.TEXT_SHARD, "text"),
        empty=out(paths.TEXT_EMPTY),
    output:
        adapter=out(paths.ADAPTER_FILE),
        metrics=out(paths.METRICS),
        # An output, not an input: a redrawn plot never makes training rerun; report() puts it in
        # `snakemake --report`'s bundle (the run report draws its own from the metrics).
        loss=report(out(paths.LOSS_PLOT), caption="../report/loss.rst", category="Training"),
    # launcher: resources.mpi split into words and each one shell-quoted
    # (dw.launcher_args), so a profile's launcher cannot run anything but itself.
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "train"),
        launcher=dw.launcher_args,
    # --auto-resume: a rerun after an interruption continues from the last checkpoint
    # that fits (Snakemake reruns an incomplete job; the checkpoints are not its outputs).
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
        "{params.launcher} diffpipe train --config {params.config:q} --processes {resources.gpu:q} --auto-resume"
        " > {log:q} 2>&1"
