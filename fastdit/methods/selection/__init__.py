"""What the dynamic methods share to choose their blocks: k-means (``kmeans``: svg2's clusters),
block-mass estimators (``mass``: sparge's and svg2's kept-mass selection) and selection reuse
across steps (``reuse``: sparge, svg, svg2's ``reuse_threshold``)."""
