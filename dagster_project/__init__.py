"""Dagster definitions for dflash-assets: assets, checks, resources, partitions.

Thin by design: each asset body reads its partition key and config, calls one
``dflash_assets`` function, writes through the store and returns metadata.
"""
