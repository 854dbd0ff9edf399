"""The caches: the shard plan (buckets, frames), the content-addressed store, the latent and text
formats, the cache jobs and the reader training uses."""
