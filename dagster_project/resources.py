"""Resources shared by the stages: the store and the target model.

The store is addressed by one URI (a local directory by default, or
``s3://bucket/prefix``); S3 clients come from dagster-aws's ``S3Resource``,
with credentials from the environment (never logged).
"""

from __future__ import annotations

from typing import Optional

import dagster as dg
from pydantic import Field

from dflash_assets.store import LocalStore, S3Store, default_store_uri, open_store


class StoreResource(dg.ConfigurableResource):
    """Where every asset's data lives: a local directory or ``s3://bucket/prefix``."""

    uri: str = Field(default_factory=default_store_uri, description="Store root: a directory or s3://bucket/prefix.")
    endpoint_url: Optional[str] = Field(default=None, description="S3 endpoint (MinIO, moto, ...); None for AWS.")
    region_name: Optional[str] = Field(default=None, description="S3 region; None reads the environment.")

    def open(self) -> LocalStore | S3Store:
        if self.uri.startswith("s3://"):
            from dagster_aws.s3 import S3Resource

            client = S3Resource(endpoint_url=self.endpoint_url, region_name=self.region_name).get_client()
            return open_store(self.uri, s3_client=client)
        return open_store(self.uri)
