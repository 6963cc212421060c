import numpy as np

from edgeflow.evaluation import plots

PNG = b"\x89PNG\r\n\x1a\n"


def _image(path):
    import matplotlib.image

    return matplotlib.image.imread(path)


def test_plots_are_png_files_with_content(tmp_path):
    errors = {"awq": [0.01, 0.02, 0.05], "gptq": [0.02, 0.03, 0.04]}
    rng = np.random.default_rng(0)
    made = [
        plots.layer_error_plot(errors, tmp_path / "layer.png"),
        plots.agreement_histogram({"awq": list(rng.uniform(0.6, 1, 50)), "gptq": [1.0] * 50}, 0.9, tmp_path / "agree.png"),
        plots.kl_distribution({"awq": rng.exponential(0.01, 500), "gptq": np.zeros(500)}, 0.02, tmp_path / "kl.png"),
    ]
    for path in made:
        assert path.read_bytes()[:8] == PNG
        img = _image(path)
        # something was drawn: more than a blank canvas (several distinct colours)
        assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 10
