"""The built-in families: one line each, name -> module.

Modules are imported on first use, so a cache or sample job pays only for
its own family's imports (all of them through diffusers cost seconds a job).
"""

FAMILY_MODULES: dict[str, str] = {
    "chroma": "diffpipe.models.chroma",
    "cogvideox": "diffpipe.models.cogvideox",
    "cogview4": "diffpipe.models.cogview4",
    "cosmos2": "diffpipe.models.cosmos2",
    "cosmos2-video": "diffpipe.models.cosmos2_video",
    "flux": "diffpipe.models.flux",
    "flux-kontext": "diffpipe.models.flux_kontext",
    "hidream": "diffpipe.models.hidream",
    "hunyuanvideo": "diffpipe.models.hunyuanvideo",
    "ltxvideo": "diffpipe.models.ltxvideo",
    "lumina2": "diffpipe.models.lumina2",
    "mochi": "diffpipe.models.mochi",
    "qwenimage": "diffpipe.models.qwenimage",
    "qwenimage-edit": "diffpipe.models.qwenimage_edit",
    "sd": "diffpipe.models.sd",
    "sd3": "diffpipe.models.sd3",
    "sdxl": "diffpipe.models.sdxl",
    "wan": "diffpipe.models.wan",
}
