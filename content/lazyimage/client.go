package lazyimage

import (
	"os"
	"path/filepath"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/registry"
)

// ClientFromConfig makes a registry client as the node's containerd
// reaches registries: hosts from the [kata_fsx.registry] config_path
// directory, credentials from auth_file, else the docker config.json
// docker login writes ($DOCKER_CONFIG/config.json, else
// ~/.docker/config.json).
func ClientFromConfig(cfg config.Registry) *registry.Client {
	auth := cfg.AuthFile
	if auth == "" {
		auth = dockerConfigFile()
	}
	return registry.New(registry.Options{ConfigPath: cfg.ConfigPath, Credentials: registry.DockerConfigCredentials(auth), UserAgent: "kata-fsx"})
}

func dockerConfigFile() string {
	if d := os.Getenv("DOCKER_CONFIG"); d != "" {
		return filepath.Join(d, "config.json")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		// No home: no credentials (a missing file means none).
		return ""
	}
	return filepath.Join(home, ".docker", "config.json")
}
