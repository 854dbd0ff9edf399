# Validation decodes new files in a pool of worker processes: one per thread.
rule validate:
    input:
        dw.dataset_inputs(CFG),
    # update(): Snakemake must not delete the previous manifest before the job,
    # it is what lets validation skip files whose size and mtime are unchanged.
    output:
        manifest=update(out(paths.MANIFEST)),
        report=update(out(paths.REPORT_JSON)),
        html=update(out(paths.REPORT_HTML)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "validate"),
    threads: workflow.cores
    log:
        out("logs/validate.log"),
    benchmark:
        out("benchmarks/validate.tsv")
    shell:
        "diffpipe validate --config {params.config} --workers {threads} > {log} 2>&1"
