"""Stage 4, hidden-state caches: the safetensors shard format (`format`) and the capture of the DFlash layers (`capture`)."""
