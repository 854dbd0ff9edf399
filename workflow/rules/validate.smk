# Validation decodes new files in a pool of worker processes: one per thread.
rule validate:
    input:
        dw.dataset_fingerprint(CFG),
    # update(): Snakemake must not delete the previous manifest before the job,
    # it is what lets validation skip files whose size and mtime are unchanged.
    output:
        manifest=update(out(paths.MANIFEST)),
        report=update(out(paths.REPORT_JSON)),
        html=update(out(paths.REPORT_HTML)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "validate"),
    # Scaled down to the cores Snakemake has (locally, or inside a SLURM job).
    threads: 64
    log:
        out("logs/validate.log"),
    benchmark:
        out("benchmarks/validate.tsv")
    shell:
        "diffpipe validate --config {params.config:q} --workers {threads:q} > {log:q} 2>&1"
