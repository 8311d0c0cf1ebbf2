"""Stage 4, hidden-state caches: the safetensors shard format and its reader (`format`), samples grouped into forwards
and files (`batching`), packed causal attention (`packing`), the capture of the DFlash layers (`capture`), the stage
over the store with its Pipes entry (`stage`), and a bounded local cache of parts for training (`part_cache`)."""
