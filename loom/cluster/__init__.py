"""Operations around a training job: the environment doctor, cluster launchers and their manifests."""
