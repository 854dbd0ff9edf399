rule export:
    input:
        out(paths.ADAPTER_FILE),
    output:
        out(paths.EXPORT_DIFFUSERS),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "export"),
    log:
        out("logs/export.log"),
    benchmark:
        out("benchmarks/export.tsv")
    shell:
        "diffpipe export --config {params.config} > {log} 2>&1"
