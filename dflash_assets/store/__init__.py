"""Where every asset's data lives: one store URI (local directory or s3://) with atomic writes (`backends`), the key
layout of every asset (`layout`), multi-file outputs published as one through a manifest (`manifest`), and the Arrow
types of the conversation data the stages hand each other (`schemas`)."""
