# Validation decodes new files in a pool of worker processes: one per thread.
# With validation.shards > 1, one validate_shard job per validation shard probes its
# part of the listing first (a cluster profile spreads them over nodes); validate merges.
rule validate:
    input:
        dw.dataset_fingerprint(CFG),
        dw.validation_probes(CFG),
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


# Its input is its own listing fingerprint (written with the dataset's): a changed file
# reruns only its shard. update(): the previous table is what lets it skip unchanged files.
rule validate_shard:
    input:
        out(paths.VALIDATE_LISTING),
    output:
        update(out(paths.VALIDATE_PROBE)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "validate"),
    threads: 64
    log:
        out("logs/validate/{vshard}.log"),
    benchmark:
        out("benchmarks/validate/{vshard}.tsv")
    shell:
        "diffpipe validate-shard --config {params.config:q} --shard {wildcards.vshard:q} --workers {threads:q}"
        " > {log:q} 2>&1"
