package registry

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

// Credentials are a user name and secret for a registry; an empty Username
// with a Secret is an identity token.
type Credentials struct {
	Username, Secret string
}

// CredentialFunc gives the credentials for a registry host (host[:port]),
// or zero Credentials when there are none.
type CredentialFunc func(host string) (Credentials, error)

// DockerConfigCredentials reads credentials from a docker config.json's
// "auths" section, as docker login writes it (auth, or username and
// password, keyed by host or by https://host/...). Docker Hub's entry is
// https://index.docker.io/v1/. A missing file means no credentials.
func DockerConfigCredentials(file string) CredentialFunc {
	return func(host string) (Credentials, error) {
		data, err := os.ReadFile(file)
		if errors.Is(err, os.ErrNotExist) {
			return Credentials{}, nil
		}
		if err != nil {
			return Credentials{}, fmt.Errorf("docker config %s: %w", file, err)
		}
		var cfg struct {
			Auths map[string]struct {
				Auth          string `json:"auth"`
				Username      string `json:"username"`
				Password      string `json:"password"`
				IdentityToken string `json:"identitytoken"`
			} `json:"auths"`
		}
		if err := json.Unmarshal(data, &cfg); err != nil {
			return Credentials{}, fmt.Errorf("docker config %s: %w", file, err)
		}
		want := host
		if host == DockerHub || host == dockerHubHost {
			want = "index.docker.io"
		}
		for k, a := range cfg.Auths {
			kh := k
			if u, err := url.Parse(k); err == nil && u.Host != "" {
				kh = u.Host
			}
			if kh != want && !(want == "index.docker.io" && kh == DockerHub) {
				continue
			}
			if a.IdentityToken != "" {
				return Credentials{Secret: a.IdentityToken}, nil
			}
			if a.Auth != "" {
				raw, err := base64.StdEncoding.DecodeString(a.Auth)
				if err != nil {
					return Credentials{}, fmt.Errorf("docker config %s: auths.%q.auth: %w", file, k, err)
				}
				u, p, ok := strings.Cut(string(raw), ":")
				if !ok {
					return Credentials{}, fmt.Errorf("docker config %s: auths.%q.auth is not user:password", file, k)
				}
				return Credentials{Username: u, Secret: p}, nil
			}
			return Credentials{Username: a.Username, Secret: a.Password}, nil
		}
		return Credentials{}, nil
	}
}

// Challenge is one WWW-Authenticate challenge.
type Challenge struct {
	Scheme string
	Params map[string]string
}

// maxChallenge bounds a parsed WWW-Authenticate header.
const maxChallenge = 8 << 10

// ParseChallenges parses WWW-Authenticate header values (RFC 7235: a scheme,
// then comma-separated key=value or key="quoted value" parameters).
func ParseChallenges(values []string) ([]Challenge, error) {
	var out []Challenge
	for _, v := range values {
		if len(v) > maxChallenge {
			return nil, fmt.Errorf("WWW-Authenticate longer than %d bytes", maxChallenge)
		}
		s := strings.TrimSpace(v)
		for s != "" {
			sp := strings.IndexAny(s, " \t")
			scheme := s
			if sp >= 0 {
				scheme, s = s[:sp], strings.TrimLeft(s[sp:], " \t")
			} else {
				s = ""
			}
			c := Challenge{Scheme: strings.ToLower(scheme), Params: map[string]string{}}
			for s != "" {
				eq := strings.IndexByte(s, '=')
				if eq <= 0 {
					break // the next challenge's scheme
				}
				key := strings.ToLower(strings.TrimSpace(s[:eq]))
				if strings.ContainsAny(key, " \t,") {
					break
				}
				s = strings.TrimLeft(s[eq+1:], " \t")
				var val string
				if strings.HasPrefix(s, `"`) {
					var b strings.Builder
					i := 1
					for ; i < len(s) && s[i] != '"'; i++ {
						if s[i] == '\\' && i+1 < len(s) {
							i++
						}
						b.WriteByte(s[i])
					}
					if i >= len(s) {
						return nil, fmt.Errorf("WWW-Authenticate %q: unterminated quoted value", truncate(v))
					}
					val, s = b.String(), s[i+1:]
				} else {
					end := strings.IndexByte(s, ',')
					if end < 0 {
						end = len(s)
					}
					val, s = strings.TrimSpace(s[:end]), s[end:]
				}
				c.Params[key] = val
				s = strings.TrimLeft(s, " \t")
				if strings.HasPrefix(s, ",") {
					s = strings.TrimLeft(s[1:], " \t")
				}
			}
			out = append(out, c)
		}
	}
	return out, nil
}

// maxTokenResponse bounds a token server's answer.
const maxTokenResponse = 1 << 20

// realmURL gives a bearer challenge's realm, an http(s) URL.
func realmURL(c Challenge) (*url.URL, error) {
	realm := c.Params["realm"]
	u, err := url.Parse(realm)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return nil, fmt.Errorf("bearer challenge realm %q is not an http(s) URL", truncate(realm))
	}
	return u, nil
}

// fetchToken asks realm (c's) for a token for scope, with basic
// credentials when there are some (Docker's token protocol, GET).
func fetchToken(ctx context.Context, hc *http.Client, realm *url.URL, c Challenge, scope string, cred Credentials) (string, error) {
	u := *realm
	q := u.Query()
	if s := c.Params["service"]; s != "" {
		q.Set("service", s)
	}
	if s := c.Params["scope"]; s != "" {
		scope = s
	}
	if scope != "" {
		q.Set("scope", scope)
	}
	u.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return "", err
	}
	if cred.Username != "" || cred.Secret != "" {
		req.SetBasicAuth(cred.Username, cred.Secret)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("token from %s: %w", u.Host, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxTokenResponse+1))
	if err != nil {
		return "", fmt.Errorf("token from %s: %w", u.Host, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("token from %s: %s", u.Host, resp.Status)
	}
	if len(body) > maxTokenResponse {
		return "", fmt.Errorf("token from %s: answer longer than %d bytes", u.Host, maxTokenResponse)
	}
	var t struct {
		Token       string    `json:"token"`
		AccessToken string    `json:"access_token"`
		ExpiresIn   int       `json:"expires_in"`
		IssuedAt    time.Time `json:"issued_at"`
	}
	if err := json.Unmarshal(body, &t); err != nil {
		return "", fmt.Errorf("token from %s: %w", u.Host, err)
	}
	tok := t.Token
	if tok == "" {
		tok = t.AccessToken
	}
	if tok == "" {
		return "", fmt.Errorf("token from %s: answer has no token", u.Host)
	}
	return tok, nil
}
