"""What a user configures and how it is read: the options, the combination table, config files (Accelerate's too);
:mod:`.resolve` combines them into one :class:`~fp8dist.config.resolve.Config`."""
