"""Release assets: publish one version's files, with a checksum manifest, to a release store.

`job.publish` is the ordered pipeline (checksums, lease, retag, delete old assets, parallel
uploads with retries, the checksum file last, verify); `stores.open_store` turns a STORE spec
(`s3://`, `github://`, `oci://`) into one of the `ReleaseStore` implementations.
"""
